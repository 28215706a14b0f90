"""CUDA-graph decode's padding (engine/cuda_graphs.py), checked on CPU by running the padded static-buffer
path eagerly (capture=False): decode batches padded to the next size give transformers' tokens, with the
torch backend and with the Triton kernels (through Triton's interpreter); prefill steps and batches past the
largest size run eager; the size ladder. Capture itself needs CUDA: tests/gpu/test_cuda_graphs.py."""
from __future__ import annotations

import random

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.cuda_graphs import DecodeGraphs, graph_sizes

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
    outs = llm.generate(prompts, [SamplingParams(max_tokens=3 + i, **GREEDY) for i in range(7)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 3 + i) for i, p in enumerate(prompts)]
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
    """What the engine sets up on CUDA with overlap_decode, over the padded eager path."""
    graphs = _padded(llm, sizes)
    eng = llm.engine
    eng.runner.overlap_decode = True
    eng.runner.max_model_len = eng.max_model_len
    eng.scheduler.num_lookahead_tokens = 1
    return graphs


def _free(llm):
    pool = llm.engine.kv_cache_manager.pool
    return pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_steps_launched_ahead_give_transformers_tokens(checkpoints, hf_reference, backend):
    """Steps launched on the device-side ids of the step before: the same tokens as transformers, through block
    boundaries (block_size 8: the scheduler allocates the next block a step early), requests ending at
    different max_tokens, and padded batch sizes. Every step launched ahead is used: none is launched past a
    request's max_tokens."""
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    path = checkpoints["llama"]
    llm = LLM(path, attention_backend=backend, cache={"num_blocks": 64, "block_size": 8})
    graphs = _overlapped(llm, [1, 2, 4, 8])
    prompts = _prompts(5, seed=11)
    lens = [5, 12, 9, 17, 3]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, n) for p, n in zip(prompts, lens)]
    runner = llm.engine.runner
    assert runner._ahead is None
    # 16 decode steps (tokens 2..17). Run in order: the first, and the one after each step that ends a request
    # (tokens 4, 6, 10 and 13, after 3, 5, 9 and 12): the other 11 were launched by the step before them.
    assert runner.num_overlapped_steps == 16
    assert runner.num_ahead_used == runner.num_launched_ahead == 11
    assert graphs.num_steps == 16                     # 5 in order + 11 launched ahead: no forward wasted
    assert _free(llm)


def test_a_step_launched_ahead_is_thrown_away_when_a_request_stops(checkpoints, hf_reference):
    """Greedy requests only, two ending on a stop token mid-way: the steps launched ahead of those ends are not
    the scheduled ones, so they are thrown away (their KV writes overwritten or never read), and everyone
    keeps transformers' tokens."""
    path = checkpoints["mistral"]
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    _overlapped(llm, [1, 2, 4])
    prompts = _prompts(4, seed=41)
    refs = [hf_reference(path, p, 20) for p in prompts]
    stops = {0: refs[0][6], 2: refs[2][11]}
    params = [SamplingParams(max_tokens=20, stop_token_ids=[stops[i]] if i in stops else [], **GREEDY)
              for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.outputs[0].token_ids == (r[:r.index(stops[i]) + 1] if i in stops else r), i
    runner = llm.engine.runner
    assert runner.num_launched_ahead - runner.num_ahead_used == 2      # one thrown away per stop
    assert runner.num_ahead_used > 10
    assert _free(llm)


def test_sampled_requests_overlap_with_the_draws_of_an_in_order_run(checkpoints):
    """Seeded sampling (temperature, top-k / top-p / min-p), logit_bias, penalties and greedy in one batch
    overlap: the steps launched ahead count the pending ids in the penalties and draw on the device for the next
    output index, so every token equals the in-order run
    (overlap off); the greedy row also equals the run without graph buffers. Unseeded draws overlap too and
    lose nothing."""
    path = checkpoints["qwen2"]
    prompts = _prompts(6, seed=51)
    params = [SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=1.2, top_k=20, min_p=0.05, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, logit_bias={7: 2.5, 9: -3.0}, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.8, seed=9, repetition_penalty=1.4, frequency_penalty=0.6,
                             ignore_eos=True),
              SamplingParams(max_tokens=15, temperature=0.0, presence_penalty=1.5, repetition_penalty=1.2,
                             ignore_eos=True)]
    runs = {}
    for mode in ("overlap", "in order", "plain"):
        llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
        if mode != "plain":
            _overlapped(llm, [1, 2, 4, 8])
            llm.engine.runner.overlap_decode = mode == "overlap"
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode == "overlap":
            runner = llm.engine.runner
            assert runner.num_ahead_used == runner.num_launched_ahead > 10
        assert _free(llm)
    assert runs["overlap"] == runs["in order"]          # the same padded forwards: bitwise the same logits
    assert runs["overlap"][2] == runs["plain"][2]         # the greedy row also without padding (draws could
    #                                                       flip on a near-tie between GEMM shapes)
    assert [len(t) for t in runs["overlap"]] == [18, 14, 16, 12, 17, 15]
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    _overlapped(llm, [1, 2, 4])
    unseeded = [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 3
    assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts[:3], unseeded, use_tqdm=False)] == [15] * 3
    assert llm.engine.runner.num_ahead_used > 5 and _free(llm)


def test_requests_with_logprobs_overlap_and_hand_out_the_in_order_logprobs(checkpoints):
    """Logprobs (the chosen id's only, and top 2 / top 5) on greedy, seeded and penalised rows: the steps
    launched ahead compute them on the device with their ids, and every token, logprob, rank and top list
    equals the run with overlap off over the same padded forwards."""
    path = checkpoints["llama"]
    prompts = _prompts(4, seed=61)
    params = [SamplingParams(max_tokens=14, temperature=0.0, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.9, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    runs = {}
    for mode in ("overlap", "in order"):
        llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
        _overlapped(llm, [1, 2, 4])
        llm.engine.runner.overlap_decode = mode == "overlap"
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        if mode == "overlap":
            runner = llm.engine.runner
            assert runner.num_ahead_used == runner.num_launched_ahead > 10
        assert _free(llm)
    assert runs["overlap"] == runs["in order"]
    ids, lps = runs["overlap"][2]
    assert len(lps) == len(ids) == 12 and all(len(lp.top_token_ids) == 5 and lp.rank >= 1 for lp in lps)
    assert all(lp.top_token_ids == [] for lp in runs["overlap"][0][1]) and runs["overlap"][3][1] is None


def test_stop_tokens_and_other_params_fall_back_and_lose_nothing(checkpoints, hf_reference):
    """A greedy request with a stop token, a sampled one and one asking for logprobs in the same batch: the
    steps launched ahead of the stop are thrown away; alone, the greedy one overlaps on. Tokens are
    transformers' where greedy, seeded draws repeat, logprobs match the run without graph buffers, every block
    comes back."""
    path = checkpoints["qwen2"]
    ref_llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    llm = LLM(path, cache={"num_blocks": 64, "block_size": 8})
    _overlapped(llm, [1, 2, 4])
    prompts = _prompts(4, seed=21)
    ref = hf_reference(path, prompts[0], 12)
    eos = ref[5]                                                 # stops at the first occurrence of this id
    params = [SamplingParams(max_tokens=12, stop_token_ids=[eos], **GREEDY),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=16, **GREEDY)]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = ref_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].token_ids == ref[:ref.index(eos) + 1]
    assert got[3].outputs[0].token_ids == hf_reference(path, prompts[3], 16)
    assert [lp.logprob for lp in got[2].outputs[0].logprobs] == pytest.approx(
        [lp.logprob for lp in want[2].outputs[0].logprobs], abs=1e-5)      # padded rows: other GEMM shapes
    assert llm.engine.runner.num_ahead_used > 0       # the last greedy request decodes alone, overlapped
    assert _free(llm)


def test_arrivals_aborts_and_preemption_between_overlapped_steps(checkpoints, hf_reference):
    """The engine driven step by step: requests arrive while others decode with steps launched ahead, one is
    aborted, and a pool too small for all of them preempts (at prefill chunks and block boundaries, where no
    step is launched ahead). The step launched ahead is used only when it is the scheduled step; tokens
    stay transformers', and every block comes back."""
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
    eng.add_request(eng.make_request(prompts[0], params, req_id="r0"))
    eng.add_request(eng.make_request(prompts[1], params, req_id="r1"))
    steps = 0
    aborted = False
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        for d in out.deltas:
            got[d.req_id].extend(d.token_ids)
        if steps == 5:
            eng.add_request(eng.make_request(prompts[2], params, req_id="r2"))               # arrives mid-decode
        if steps == 8:
            eng.add_request(eng.make_request(prompts[3], params, req_id="r3"))
        if not aborted and len(got["r3"]) >= 3:
            eng.abort_request("r3")
            aborted = True
    assert aborted
    assert eng.last_stats.num_preemptions_total > 0
    for r in ("r0", "r1", "r2"):
        assert got[r] == want[r], r
    assert got["r3"] == want["r3"][:len(got["r3"])]
    assert eng.runner.num_ahead_used > 0
    assert eng.runner.num_launched_ahead > eng.runner.num_ahead_used    # the arrivals and the abort
    assert _free(llm)


# ---------------------------------------------------------------- cascade graphs (a prefix the batch shares)
def test_shared_prefix_counts_whole_blocks_every_request_has_before_its_token():
    from types import SimpleNamespace

    import numpy as np
    import torch

    graphs = DecodeGraphs(None, [], SimpleNamespace(cascade_min_tokens=16, device_cascade_len=True), [1, 2, 4], 8, 8,
                          torch.device("cpu"), capture=False)
    stale = 99                                         # packed-table columns past a row's own blocks
    tables = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 7, stale], [1, 2, 3, 4, 9]])
    blocks = [[1, 2, 3, 4, 5], [1, 2, 3, 7], [1, 2, 3, 4, 9]]
    assert graphs._shared_prefix(tables, blocks, np.array([35, 30, 36])) == 24       # 3 blocks in common
    assert graphs._shared_prefix(tables, blocks, np.array([35, 23, 36])) == 16       # one is at token 23
    assert graphs._shared_prefix(tables, blocks, np.array([35, 15, 36])) == 0        # 8 < cascade_min_tokens
    assert graphs._shared_prefix(tables[:1], blocks[:1], np.array([35])) == 0        # a batch of one
    tables[1, 0] = 6
    assert graphs._shared_prefix(tables, blocks, np.array([35, 30, 36])) == 0
    both = (tables[[0, 2]], [blocks[0], blocks[2]], np.array([35, 36]))
    assert graphs._shared_prefix(*both) == 32
    graphs.backend.device_cascade_len = False          # a backend that cannot read the length from the device
    assert graphs._shared_prefix(*both) == 0
    graphs.backend.device_cascade_len, graphs.backend.cascade_min_tokens = True, None      # switched off
    assert graphs._shared_prefix(*both) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_decode_in_cascade_matches_transformers(monkeypatch, checkpoints, hf_reference, overlap):
    """Five requests on a cached 40-token prefix, padded to 8 (the padding rows read the prefix too): the
    step's shared length reaches the kernels through the device buffer a graph would replay with, in order
    and launched ahead (run_next keeps it), and the tokens are transformers'."""
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import triton_paged

    path = checkpoints["llama"]
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 64, "block_size": 8})
    llm.engine.runner.backend.cascade_min_tokens = 16
    graphs = _overlapped(llm, [1, 2, 4, 8]) if overlap else _padded(llm, [1, 2, 4, 8])
    rng = random.Random(51)
    prefix = [rng.randrange(10, 700) for _ in range(40)]
    llm.generate([prefix + [5]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    prompts = [prefix + [rng.randrange(10, 700) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    seen = []
    forward = triton_paged.TritonPagedAttention.forward
    monkeypatch.setattr(triton_paged.TritonPagedAttention, "forward",
                        lambda self, q, k, v, cache, meta, scale: (
                            seen.append(None if meta.cascade_prefix_len is None else int(meta.cascade_prefix_len)),
                            forward(self, q, k, v, cache, meta, scale))[1])
    lens = [5, 7, 3, 9, 5]                                   # 8 decode steps, 4 of them launched ahead
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, n) for p, n in zip(prompts, lens)]
    assert graphs.num_cascade_steps >= 3 and 40 in seen      # 5 blocks shared: every real row's first 40 keys
    assert set(seen) <= {None, 40}
    if overlap:                                              # steps launched ahead (run_next) kept the length
        assert llm.engine.runner.num_ahead_used >= 3
    assert _free(llm)
