"""Greedy decoding token-identical to transformers, through chunking, prefix hits, preemption, aborts."""
import random

import pytest
import torch

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.llm_engine import LLMEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n, lo=3, hi=40, seed=0, vocab=700):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path, **kw):
    kw.setdefault("cache", {"num_blocks": 128, "block_size": 8})
    return LLM(path, **kw)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_single_requests_match_transformers(checkpoints, hf_reference, name):
    path = checkpoints[name]
    llm = _engine(path)
    for ids in _prompts(3, seed=1):
        out = llm.generate([ids], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_reference(path, ids, 12)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("linear,cpu_kernels", [("torch", False), ("onednn", True), ("hybrid", True)])
def test_gemm_and_decode_kernel_paths_match(checkpoints, hf_reference, monkeypatch, linear, cpu_kernels):
    """The CPU GEMM paths (F.linear, oneDNN prepacked, prepacked + plain for 1-2 rows) and both decode and
    per-token-op paths (torch; the C decode kernel and C fused ops)."""
    from affinity_serve.engine.attention import cpu_kernels as ck
    from affinity_serve.engine.models.linear import prepack_supported
    if cpu_kernels and ck.load() is None:
        pytest.skip("no C compiler here: the C decode kernel cannot be built")
    if linear != "torch" and not prepack_supported(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN")
    path = checkpoints["qwen2"]                      # QKV bias: the packed linear's bias path too
    llm = _engine(path, linear_backend=linear, cpu_kernels=cpu_kernels)
    assert llm.engine.linear_backend == linear
    assert (llm.engine.runner.backend.decode_kernel is not None) == cpu_kernels
    model = llm.engine.runner.model
    assert model.fused == cpu_kernels and isinstance(model.ops, ck.CpuOps) == cpu_kernels
    from affinity_serve.engine.models.linear import PackedLinear
    rows, forward = [], PackedLinear.forward

    def spy(self, x):
        rows.append((x.numel() // self.in_features, self.plain_rows))
        return forward(self, x)
    monkeypatch.setattr(PackedLinear, "forward", spy)
    prompts = _prompts(4, lo=1, hi=40, seed=21)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 10) for p in prompts]
    one = llm.generate(prompts[:1], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]   # 1-row decode
    assert one.outputs[0].token_ids == outs[0].outputs[0].token_ids
    if linear == "hybrid":          # both sides of the split ran: 1-2 row inputs (the plain copy) and more
        assert {r <= p for r, p in rows} == {True, False}
    else:
        assert all(p == 0 for _, p in rows) and (linear == "torch") == (not rows)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_mixed_batch_and_tiny_budget_match(checkpoints, hf_reference, name):
    path = checkpoints[name]
    prompts = _prompts(6, lo=1, hi=50, seed=2)
    refs = [hf_reference(path, p, 10) for p in prompts]
    for sched in ({"max_num_batched_tokens": 256}, {"max_num_batched_tokens": 7},
                  {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 5}):
        llm = _engine(path, scheduler=sched)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs, sched


def test_shared_prefix_reports_cached_tokens_and_matches(checkpoints, hf_reference):
    path = checkpoints["llama"]
    llm = _engine(path)
    prefix = _prompts(1, lo=30, hi=30, seed=3)[0]
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    first = llm.generate([a], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    second = llm.generate([b], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 24          # 3 full blocks of 8 from the 30-token prefix
    assert first.outputs[0].token_ids == hf_reference(path, a, 8)
    assert second.outputs[0].token_ids == hf_reference(path, b, 8)
    stats = llm.engine.last_stats
    assert stats.prefix_cache_hits_total == 24


def test_preemption_keeps_outputs_identical(checkpoints, hf_reference):
    path = checkpoints["llama"]
    prompts = _prompts(5, lo=10, hi=20, seed=4)
    refs = [hf_reference(path, p, 24) for p in prompts]
    llm = _engine(path, cache={"num_blocks": 14, "block_size": 4})       # 52 tokens for 5 x ~40
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    assert llm.engine.last_stats.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_abort_mid_stream_frees_blocks_others_unaffected(checkpoints, hf_reference):
    path = checkpoints["qwen2"]
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 64, "block_size": 4}))
    prompts = _prompts(3, lo=8, hi=12, seed=5)
    for i, p in enumerate(prompts):
        eng.add_request(eng.make_request(p, SamplingParams(max_tokens=10, **GREEDY), req_id=f"r{i}"))
    got = {f"r{i}": [] for i in range(3)}
    steps = 0
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        for d in out.deltas:
            got[d.req_id] += d.token_ids
        if steps == 3:
            eng.abort_request("r1")
    assert got["r0"] == hf_reference(path, prompts[0], 10)
    assert got["r2"] == hf_reference(path, prompts[2], 10)
    assert 0 < len(got["r1"]) < 10
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not eng.scheduler.requests
    eng.step()                       # the runner drops finished state when the next step tells it
    assert not eng.runner.requests


def test_seeded_sampling_reproducible_across_batches(checkpoints):
    path = checkpoints["llama"]
    llm = _engine(path)
    target = _prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(4, seed=7)
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 2 + [params]
                         + [SamplingParams(max_tokens=5, temperature=1.3, ignore_eos=True)] * 2, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    # and across preemption: a tiny pool forces recompute
    small = _engine(path, cache={"num_blocks": 20, "block_size": 4})
    outs = small.generate([target] + others[:3], [params] + [params] * 3, use_tqdm=False)
    assert small.engine.last_stats.num_preemptions_total > 0
    assert outs[0].outputs[0].token_ids == alone


def test_logprobs_match_transformers(checkpoints, hf_reference):
    import torch
    path = checkpoints["qwen2"]
    llm = _engine(path)
    ids = _prompts(1, seed=8)[0]
    out = llm.generate([ids], SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    full = ids + out.token_ids
    ref = torch.log_softmax(hf_reference.logits(path, full), dim=-1)
    assert len(out.logprobs) == 5
    for i, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == out.token_ids[i] and lp.rank == 1
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert lp.top_token_ids == row.topk(3).indices.tolist()
        assert lp.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("name", ["mistral", "llama_tied_sharded", "llama_linear", "llama_llama3", "qwen2_yarn"])
def test_architectures_rope_scaling_tied_and_sharded(checkpoints, hf_reference, name):
    path = checkpoints[name]
    llm = _engine(path)
    prompts = _prompts(2, lo=60, hi=90, seed=9)      # past the llama3/yarn original context
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 8) for p in prompts]


def test_n_samples_and_text_prompts_and_chat(checkpoints):
    path = checkpoints["llama"]
    llm = _engine(path)
    out = llm.generate("The quick brown fox", SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5,
                                                             ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok.encode("The quick brown fox")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, **GREEDY),
                    use_tqdm=False)[0]
    expected = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                       tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat.prompt_token_ids == list(expected)


@pytest.mark.parametrize("least", [64, None], ids=["cascade", "cascade_min_tokens-null"])
def test_concurrent_shared_prefix_decode_matches(monkeypatch, checkpoints, hf_reference, least):
    """Several requests decoding together over a long shared prefix: the cascade attention path, and with
    `cascade_min_tokens: null` the plain one; transformers' tokens either way."""
    import affinity_serve.engine.attention.torch_paged as tp
    calls = []
    real = tp._cascade_decode
    monkeypatch.setattr(tp, "_cascade_decode", lambda *a: (calls.append(1), real(*a))[1])
    path = checkpoints["qwen2"]
    prefix = _prompts(1, lo=80, hi=80, seed=11)[0]
    prompts = [prefix + tail for tail in ([5], [6, 7], [8, 9, 10], [11, 12, 13, 14])]
    llm = _engine(path, cascade_min_tokens=least)
    assert llm.engine.runner.backend.cascade_min_tokens == least
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 10) for p in prompts]
    assert sum(o.num_cached_tokens for o in outs) >= 3 * 80 - 3 * 8
    assert (len(calls) >= 9 * len(llm.engine.runner.kv_caches)) == (least is not None)


def test_vllms_prompt_dicts_are_prompts_not_conversations(checkpoints, hf_reference):
    """`LLM.generate` takes vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, beside texts, token-id
    lists and conversations (a list of role/content messages)."""
    path = checkpoints["llama"]
    llm = _engine(path)
    ids = _prompts(1, seed=3)[0]
    want = hf_reference(path, ids, 6)
    params = SamplingParams(max_tokens=6, **GREEDY)
    text = llm.tokenizer.decode(ids)
    for prompts in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], [{"prompt_token_ids": ids}, ids]):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want] * len(outs)
        assert outs[0].prompt_token_ids == ids
    by_text = llm.generate([{"prompt": text}, text], params, use_tqdm=False)
    assert by_text[0].prompt_token_ids == by_text[1].prompt_token_ids
    assert by_text[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_ids": ids}], params, use_tqdm=False)


def test_yarn_scaling_serves_the_scaled_context_token_exact(tmp_path, hf_reference):
    """Qwen2.5 ships max_position_embeddings = original (32,768) and YaRN factor 4 for 131,072: the context is
    original x factor, as vLLM derives it (it was capped at max_position_embeddings), and tokens past the
    original length match transformers."""
    from affinity_serve.engine.demo import write_demo_model
    from affinity_serve.engine.models.checkpoint import resolve_context_length, validate_checkpoint
    from tests.conftest import TINY
    path = str(write_demo_model(tmp_path / "yarn", **{**TINY, "max_position_embeddings": 96}, arch="qwen2", seed=11,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 96}))
    args = validate_checkpoint(path)
    assert resolve_context_length(args, None) == 384
    assert resolve_context_length(args, 300) == 300
    with pytest.raises(ValueError, match="YaRN, original_max_position_embeddings 96 x factor 4"):
        resolve_context_length(args, 385)
    # linear scaling: max_position_embeddings as shipped (Gemma 3's 131,072 with factor 8 is already scaled)
    linear = str(write_demo_model(tmp_path / "linear", **{**TINY, "max_position_embeddings": 96}, arch="llama",
                                  seed=11, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert resolve_context_length(validate_checkpoint(linear), None) == 96
    llm = _engine(path)
    prompt = _prompts(1, lo=150, hi=160, seed=12)[0]            # past the original 96 positions
    out = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_reference(path, prompt, 8)
