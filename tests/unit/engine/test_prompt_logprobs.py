"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax on the same ids:
chunked prefill, prefix-cache bypass, preemption, top-k alternatives, n > 1; delivered exactly once."""
import random

import pytest
import torch

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.llm_engine import LLMEngine
from tests.unit.engine.helpers import make_request, make_scheduler, step

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n, lo, hi, seed, vocab=700):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _check(hf_reference, path, ids, got, k):
    """`got` is one entry per prompt token, None first, each matching transformers (float32, 1e-4)."""
    assert got is not None and len(got) == len(ids)
    assert got[0] is None
    ref = torch.log_softmax(hf_reference.logits(path, ids), dim=-1)      # [len(ids), vocab]
    for p in range(1, len(ids)):
        lp, row = got[p], ref[p - 1]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert lp.rank == int((row > row[ids[p]]).sum()) + 1
        top = row.topk(k) if k else None
        assert lp.top_token_ids == (top.indices.tolist() if k else [])
        assert lp.top_logprobs == pytest.approx(top.values.tolist() if k else [], abs=1e-4)


def _all_free(engine: LLMEngine) -> bool:
    pool = engine.kv_cache_manager.pool
    return pool.num_free_blocks == pool.num_blocks - 1 and not engine.has_unfinished_requests()


def _run(engine: LLMEngine) -> dict[str, list]:
    """Step to the end; request id -> every non-None prompt_logprobs seen, with the delta's index."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step().deltas:
            if d.prompt_logprobs is not None:
                seen.setdefault(d.req_id, []).append((d.index, d.prompt_logprobs))
    return seen


def test_sampling_params_validation():
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (-1, 21, 1.5, "3"):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 7},
                                   {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 5}],
                         ids=["whole", "budget7", "threshold5"])
def test_match_transformers_with_chunked_prefill_in_mixed_batch(checkpoints, hf_reference, sched):
    """Requests with and without prompt logprobs, chunked or not, decoding next to each other."""
    path = checkpoints["qwen2"]
    prompts = _prompts(4, lo=20, hi=45, seed=31) + [[42]]
    ks = [3, None, 0, 20, 2]
    llm = LLM(path, cache={"num_blocks": 128, "block_size": 8}, scheduler=sched)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=6, prompt_logprobs=k, **GREEDY) for k in ks],
                        use_tqdm=False)
    for ids, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check(hf_reference, path, ids, out.prompt_logprobs, k)
        assert out.outputs[0].token_ids == hf_reference(path, ids, 6)     # sampling unaffected
    assert outs[-1].prompt_logprobs == [None]                             # a one-token prompt
    assert _all_free(llm.engine)


def test_skip_prefix_cache_but_leave_blocks_cacheable(checkpoints, hf_reference):
    path = checkpoints["llama"]
    ids = _prompts(1, lo=37, hi=37, seed=32)[0]
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 64, "block_size": 8}))

    def run(rid, **kw):
        eng.add_request(eng.make_request(ids, SamplingParams(max_tokens=3, **GREEDY, **kw), req_id=rid))
        out = {"plp": [], "cached": None}
        while eng.has_unfinished_requests():
            for d in eng.step().deltas:
                out["cached"] = d.num_cached_tokens
                if d.prompt_logprobs is not None:
                    out["plp"].append(d.prompt_logprobs)
        return out

    first = run("a", prompt_logprobs=2)            # computes every position, still registers its blocks
    assert first["cached"] == 0 and len(first["plp"]) == 1
    _check(hf_reference, path, ids, first["plp"][0], 2)
    assert run("b")["cached"] == 32                # hits the 4 full blocks request "a" left cached
    hits_before = eng.last_stats.prefix_cache_hits_total
    again = run("c", prompt_logprobs=2)            # the prefix is cached, but it must not read it
    assert again["cached"] == 0 and len(again["plp"]) == 1
    assert eng.last_stats.prefix_cache_hits_total == hits_before
    _check(hf_reference, path, ids, again["plp"][0], 2)
    assert _all_free(eng)


def test_lookup_skipped_only_while_prompt_logprobs_are_owed():
    s = make_scheduler(block_size=4)
    warm = make_request("warm", list(range(100, 113)), max_tokens=1)
    s.add_request(warm)
    while s.has_unfinished_requests():
        step(s)
    plain = make_request("plain", list(range(100, 113)))
    owed = make_request("owed", list(range(100, 113)), prompt_logprobs=1)
    assert s.kv.get_computed_blocks(plain)[1] == 12
    assert s.kv.get_computed_blocks(owed) == ([], 0)
    owed.append_output_token(7)                    # resumed after its first token: already delivered
    assert s.kv.get_computed_blocks(owed)[1] == 12


def test_preemption_during_prefill_delivers_once_and_complete(checkpoints, hf_reference):
    path = checkpoints["llama"]
    prompts = _prompts(5, lo=14, hi=22, seed=33)
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 14, "block_size": 4},   # 52 tokens
                                 scheduler={"max_num_batched_tokens": 64, "long_prefill_token_threshold": 6}))
    victims = []
    preempt = eng.scheduler._preempt

    def spy(victim, *a):
        victims.append((victim.req_id, victim.num_output_tokens))
        return preempt(victim, *a)

    eng.scheduler._preempt = spy
    for i, ids in enumerate(prompts):
        eng.add_request(eng.make_request(ids, SamplingParams(max_tokens=16, prompt_logprobs=1, **GREEDY),
                                         req_id=f"r{i}"))
    seen = _run(eng)
    assert any(n_out == 0 for _, n_out in victims), "no request was preempted during its prefill"
    assert any(n_out > 0 for _, n_out in victims), "no request was preempted after its prompt"
    for i, ids in enumerate(prompts):
        assert len(seen[f"r{i}"]) == 1, "prompt logprobs delivered exactly once"
        _check(hf_reference, path, ids, seen[f"r{i}"][0][1], 1)
    assert _all_free(eng)
    eng.step()
    assert not eng.runner.requests


def test_n2_computes_once_and_reports_on_index_0(checkpoints, hf_reference):
    path = checkpoints["qwen2"]
    ids = _prompts(1, lo=30, hi=30, seed=34)[0]
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 64, "block_size": 8}))
    rows = []
    compute_logits = eng.runner.model.compute_logits
    eng.runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or compute_logits(h)
    eng.add_request(eng.make_request(ids, SamplingParams(n=2, max_tokens=4, prompt_logprobs=4, temperature=1.0, seed=3),
                                     req_id="p"))
    seen = _run(eng)
    assert [index for index, _ in seen["p"]] == [0]
    _check(hf_reference, path, ids, seen["p"][0][1], 4)
    assert sum(rows) == (len(ids) - 1) + 2 * 4          # prompt rows once, then one sampling row per token
    assert _all_free(eng)
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    out = llm.generate([ids], SamplingParams(n=2, max_tokens=3, prompt_logprobs=0, **GREEDY), use_tqdm=False)[0]
    _check(hf_reference, path, ids, out.prompt_logprobs, 0)
    assert out.num_cached_tokens == 24                   # the sibling read what index 0 computed


def test_no_extra_logits_without_prompt_logprobs(checkpoints):
    path = checkpoints["llama"]
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 64, "block_size": 8},
                                 scheduler={"max_num_batched_tokens": 16}))
    rows = []
    compute_logits = eng.runner.model.compute_logits
    eng.runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or compute_logits(h)
    for i, ids in enumerate(_prompts(3, lo=20, hi=40, seed=35)):
        eng.add_request(eng.make_request(ids, SamplingParams(max_tokens=5, logprobs=2, **GREEDY), req_id=f"r{i}"))
    assert _run(eng) == {}
    assert sum(rows) == 3 * 5                           # one logits row per sampled token, nothing else


def test_kept_for_a_request_preempted_before_its_first_token_arrived():
    """schedule() twice: the prompt completes in so1, so2 preempts the request before so1's output is in.
    Its first token is kept (it resumes without recomputing its prompt), so its prompt logprobs must be too."""
    from affinity_serve.engine.types import Logprobs, ModelRunnerOutput
    s = make_scheduler(num_blocks=5, block_size=4, long_prefill_token_threshold=4)       # 4 usable blocks
    s.add_request(make_request("c", [30 + i for i in range(12)], max_tokens=1))
    s.add_request(make_request("a", [10 + i for i in range(8)], max_tokens=3, prompt_logprobs=0))
    step(s)                                              # c: 4 of 12, a: 4 of 8
    so1 = s.schedule()                                   # c: 4 more, a: its last 4 (samples its first token)
    so2 = s.schedule()                                   # c needs a block: "a" is preempted
    assert so1.num_scheduled_tokens == {"c": 4, "a": 4} and so2.preempted_req_ids == {"a"}
    plp = [None] + [Logprobs(11 + i, -1.0, 1, [], []) for i in range(7)]
    out = s.update_from_output(so1, ModelRunnerOutput(["c", "a"], [[], [61]], None, {"a": plp}))
    assert [(d.req_id, d.token_ids, d.prompt_logprobs) for d in out.outputs] == [("a", [61], plp)]
    assert s.kv.get_computed_blocks(s.requests["a"])[1] == 4       # owes nothing now: reads the cache


def test_scoring_requests_do_not_wait_for_blocks_they_will_not_read():
    """Requests that owe prompt logprobs take no prefix hits, so the in-batch sharing wait (for a block
    another running request is computing) must not hold them back: lm-eval sends every choice of a
    question with the same context, and they should prefill together."""
    s = make_scheduler(block_size=4)
    ctx = list(range(200, 216))
    a = make_request("a", ctx + [1, 2], prompt_logprobs=0)
    b = make_request("b", ctx + [3, 4], prompt_logprobs=0)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 18, "b": 18}
    plain = make_request("plain", ctx + [5, 6])
    s.add_request(plain)
    assert "plain" not in s.schedule().num_scheduled_tokens      # a plain request still waits to share
