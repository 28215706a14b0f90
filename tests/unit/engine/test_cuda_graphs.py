"""CUDA-graph decode's padding (engine/cuda_graphs.py), checked on CPU by running the padded static-buffer
path eagerly (capture=False): decode batches padded to the next size give transformers' tokens, with the
torch backend and with the Triton kernels (through Triton's interpreter); prefill steps and batches past the
largest size run eager; the size ladder. Capture itself needs CUDA: tests/gpu/test_cuda_graphs.py."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, graph_sizes

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_size_ladder_covers_max_num_seqs():
    assert graph_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert graph_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_sizes(1000)[-2:] == [224, 256]
    assert graph_sizes(5) == [1, 2, 4, 5] and graph_sizes(1) == [1]


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(10, 700) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _padded(llm, sizes):
    eng = llm.engine
    graphs = DecodeGraphs(eng.runner.model, eng.runner.kv_caches, eng.runner.backend, sizes,
                          -(-eng.max_model_len // eng.config.cache.block_size), eng.config.cache.block_size,
                          eng.device, capture=False)
    eng.runner.decode_graphs = graphs
    return graphs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_matches_transformers(checkpoints, hf_reference, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    path = checkpoints["qwen2"]
    llm = LLM(path, attention_backend=backend, cache={"num_blocks": 64, "block_size": 8})
    graphs = _padded(llm, [1, 2, 4, 8])
    seen: list[tuple[int, int]] = []
    run = graphs.run
    graphs.run = lambda ids, computed, blocks: (seen.append((len(ids), graphs.padded_size(len(ids)))),
                                                run(ids, computed, blocks))[1]
    prompts = _prompts(7, seed=3)                      # 7 decoding together: padded to 8; fewer as they end
    outs = llm.generate(prompts, [SamplingParams(max_tokens=6 + 2 * i, **GREEDY) for i in range(7)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 6 + 2 * i) for i, p in enumerate(prompts)]
    assert (7, 8) in seen and (3, 4) in seen and (1, 1) in seen
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_prefill_steps_and_batches_past_the_largest_size_run_eager(checkpoints, hf_reference):
    path = checkpoints["llama"]
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    graphs = _padded(llm, [1, 2])
    prompts = _prompts(4, seed=5)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=4 + 3 * i, **GREEDY) for i in range(4)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 4 + 3 * i) for i, p in enumerate(prompts)]
    # one prefill step, then 3 decode steps each with 4, 3, 2 and 1 requests left: only the 2s and 1s fit
    assert graphs.num_steps == 3 + 3


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(None, [], None, [4, 2], 8, 16, "cpu", capture=False)


# ---------------------------------------------------------------- overlap_decode (a step launched ahead)
def _overlapped(llm, sizes):
    graphs = _padded(llm, sizes)
    llm.engine.runner.overlap_decode = True
    return graphs


def _free(llm):
    pool = llm.engine.kv_cache_manager.pool
    return pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_steps_launched_ahead_give_transformers_tokens(checkpoints, hf_reference, backend):
    """Steps launched on the device-side ids of the step before: the same tokens as transformers, through block
    boundaries (block_size 8: the step that needs a new block is not launched ahead), requests ending at
    different max_tokens, and padded batch sizes."""
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    path = checkpoints["llama"]
    llm = LLM(path, attention_backend=backend, cache={"num_blocks": 64, "block_size": 8})
    graphs = _overlapped(llm, [1, 2, 4, 8])
    prompts = _prompts(5, seed=11)
    lens = [9, 20, 14, 27, 3]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, n) for p, n in zip(prompts, lens)]
    runner = llm.engine.runner
    assert runner._ahead is None                     # nothing launched past the last request's max_tokens
    # 26 decode steps; of them, those after a block boundary or a request's end could not be launched ahead
    assert runner.num_overlapped_steps == 26 and 14 <= runner.num_ahead_used < 26
    # every launched step was either used or thrown away at a boundary; none past a request's max_tokens
    assert graphs.num_steps >= runner.num_overlapped_steps
    assert _free(llm)


def test_stop_tokens_and_other_params_fall_back_and_lose_nothing(checkpoints, hf_reference):
    """A greedy request that stops on its eos token (the step launched ahead is thrown away), a sampled one and
    one asking for logprobs in the same batch: the batch then decodes through the sampler; alone, the greedy
    ones overlap again. Tokens are transformers' where greedy, seeded draws repeat, every block comes back."""
    path = checkpoints["qwen2"]
    ref_llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    _overlapped(llm, [1, 2, 4])
    prompts = _prompts(4, seed=21)
    ref = hf_reference(path, prompts[0], 12)
    eos = ref[5]                                                 # stops at the first occurrence of this id
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[eos]),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=16, **GREEDY)]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = ref_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].token_ids == ref[:ref.index(eos) + 1]
    assert got[3].outputs[0].token_ids == hf_reference(path, prompts[3], 16)
    assert [lp.logprob for lp in got[2].outputs[0].logprobs] == [lp.logprob for lp in want[2].outputs[0].logprobs]
    assert llm.engine.runner.num_ahead_used > 0       # the last greedy request decodes alone, overlapped
    assert _free(llm)


def test_arrivals_aborts_and_preemption_between_overlapped_steps(checkpoints, hf_reference):
    """The engine driven step by step: a request arrives while others decode with a step launched ahead, one is
    aborted, and a pool too small for all of them preempts. The step launched ahead is used only when it is
    the scheduled step; tokens stay transformers', and every block comes back."""
    path = checkpoints["llama"]
    # 12 usable blocks of 4 tokens: three requests growing to ~30 tokens each cannot all fit, so some are
    # preempted (and recomputed) while the others decode with steps launched ahead
    llm = LLM(path, cache={"num_blocks": 13, "block_size": 4})
    _overlapped(llm, [1, 2, 4])
    eng = llm.engine
    prompts = _prompts(4, seed=31)
    prompts = [p[:14] for p in prompts]
    want = {f"r{i}": hf_reference(path, p, 16) for i, p in enumerate(prompts)}
    got: dict[str, list[int]] = {r: [] for r in want}
    params = SamplingParams(max_tokens=16, **GREEDY)
    eng.add_request("r0", prompts[0], params)
    eng.add_request("r1", prompts[1], params)
    steps = 0
    aborted = False
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        for d in out.deltas:
            got[d.request_id].extend(d.token_ids)
        if steps == 5:
            eng.add_request("r2", prompts[2], params)               # arrives mid-decode
        if steps == 8:
            eng.add_request("r3", prompts[3], params)
        if not aborted and len(got["r3"]) >= 3:
            eng.abort_request("r3")
            aborted = True
    assert aborted
    assert eng.last_stats.num_preemptions_total > 0
    for r in ("r0", "r1", "r2"):
        assert got[r] == want[r], r
    assert got["r3"] == want["r3"][:len(got["r3"])]
    assert eng.runner.num_ahead_used > 0
    assert _free(llm)
