"""CUDA-graph decode on a real GPU (issue 12, part 3): graphs are captured at start-up with the Triton
backend, decode steps replay them (padded to the next captured size) with transformers' tokens in float32
and the eager run's tokens in bfloat16; `enforce_eager` switches them off. overlap_decode (on by default) launches
steps ahead through pinned copies: the same tokens with it on and off, with stop tokens and arrivals. Skipped
without CUDA."""
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = dict(temperature=0.0, ignore_eos=True)
#: a tiny test model needs a few KiB per block: the default budget (80% of free GPU memory) would build a pool
#: of tens of millions of blocks, seconds and GBs of host memory per engine
SMALL_KV = 256 << 20


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, 700) for _ in range(rng.randint(2, 80))] for _ in range(n)]


def _llm(path, dtype, **kw):
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine import LLM
    return LLM(path, device="cuda", dtype=dtype, attention_backend="triton", scheduler={"max_num_seqs": 32},
               cache={"memory_budget_bytes": SMALL_KV}, **kw)


def test_graphs_are_captured_and_replayed_with_transformers_tokens(checkpoints, hf_reference):
    from affinity_serve.engine import SamplingParams

    path = checkpoints["llama"]
    llm = _llm(path, "float32")
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32]
    assert sorted(graphs.graphs) == [(1, False)] + [(p, c) for p in graphs.sizes[1:] for c in (False, True)]
    prompts = _prompts(11)
    params = [SamplingParams(max_tokens=5 + 3 * i, **GREEDY) for i in range(11)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 5 + 3 * i) for i, p in enumerate(prompts)]
    assert graphs.num_graph_replays > 20 and graphs.num_graph_replays == graphs.num_steps
    runner = llm.engine.runner         # overlap_decode (on by default): steps launched ahead were used
    assert runner.overlap_decode and runner.num_ahead_used > 10 and runner._ahead is None
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_bfloat16_graph_replay_gives_the_eager_tokens(checkpoints):
    from affinity_serve.engine import SamplingParams

    path = checkpoints["qwen2"]
    prompts = _prompts(24, seed=1)             # a captured size: the graph's GEMMs see the eager run's rows
    params = SamplingParams(max_tokens=24, **GREEDY)
    graphed = _llm(path, "bfloat16")
    in_order = _llm(path, "bfloat16", overlap_decode=False)
    eager = _llm(path, "bfloat16", enforce_eager=True)
    assert graphed.engine.runner.decode_graphs is not None and eager.engine.runner.decode_graphs is None
    assert not in_order.engine.runner.overlap_decode
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    c = [o.outputs[0].token_ids for o in in_order.generate(prompts, params, use_tqdm=False)]
    assert a == b == c and graphed.engine.runner.decode_graphs.num_graph_replays > 0
    assert graphed.engine.runner.num_ahead_used > 0 and in_order.engine.runner.num_ahead_used == 0


def test_overlapped_decode_with_stop_tokens_and_arrivals(checkpoints, hf_reference):
    """On CUDA the sampled ids cross to the host through a pinned buffer while the next step is already
    queued: requests ending on a stop token and requests arriving mid-decode keep transformers' tokens."""
    from affinity_serve.engine import SamplingParams

    path = checkpoints["mistral"]
    llm = _llm(path, "float32")
    eng = llm.engine
    prompts = _prompts(6, seed=3)
    refs = [hf_reference(path, p, 30) for p in prompts]
    params = [SamplingParams(max_tokens=30, stop_token_ids=[r[7 + i]], **GREEDY) for i, r in enumerate(refs)]
    got = {i: [] for i in range(6)}
    for i in range(3):
        eng.add_request(eng.make_request(prompts[i], params[i], req_id=str(i)))
    steps = 0
    while eng.has_unfinished_requests():
        for d in eng.step().deltas:
            got[int(d.req_id)].extend(d.token_ids)
        steps += 1
        if steps in (4, 9, 13):
            i = 3 + (4, 9, 13).index(steps)
            eng.add_request(eng.make_request(prompts[i], params[i], req_id=str(i)))
    for i, r in enumerate(refs):
        stop = r[7 + i]
        assert got[i] == r[:r.index(stop) + 1], i
    assert eng.runner.num_ahead_used > 0
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_torch_backend_on_cuda_runs_eager(checkpoints):
    from affinity_serve.engine import LLM
    llm = LLM(checkpoints["llama"], device="cuda", dtype="float32", attention_backend="torch",
              cache={"memory_budget_bytes": SMALL_KV})
    assert llm.engine.runner.decode_graphs is None


def test_overlapped_sampling_draws_what_the_in_order_run_draws(checkpoints):
    """Seeded sampling, logit_bias, penalties and unseeded draws through steps launched ahead on CUDA (the
    per-row values reach the device through pinned, non-blocking copies): seeded rows give the in-order run's
    tokens."""
    from affinity_serve.engine import SamplingParams

    path = checkpoints["qwen2"]
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    params += [SamplingParams(max_tokens=20, temperature=0.0, logit_bias={11: 3.0}, repetition_penalty=1.3,
                              frequency_penalty=0.5, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)]
    overlapped = _llm(path, "float32")
    in_order = _llm(path, "float32", overlap_decode=False)
    a = [o.outputs[0].token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in in_order.generate(prompts, params, use_tqdm=False)]
    assert a[:5] == b[:5] and len(a[5]) == 20
    runner = overlapped.engine.runner
    assert runner.num_ahead_used == runner.num_launched_ahead > 10
    pool = overlapped.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_overlapped_logprobs_are_the_in_order_logprobs(checkpoints):
    """Requests asking for logprobs overlap on CUDA too: the step launched ahead computes them on the device
    and queues their pinned copy with the ids; ids, ranks and top ids equal the in-order run's, logprobs to
    float32 rounding."""
    from affinity_serve.engine import SamplingParams

    path = checkpoints["llama"]
    prompts = _prompts(3, seed=9)
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=4, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    overlapped = _llm(path, "float32")
    in_order = _llm(path, "float32", overlap_decode=False)
    a = [o.outputs[0] for o in overlapped.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0] for o in in_order.generate(prompts, params, use_tqdm=False)]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    for x, y in zip(a[:2], b[:2]):
        assert [(lp.token_id, lp.rank, lp.top_token_ids) for lp in x.logprobs] == \
            [(lp.token_id, lp.rank, lp.top_token_ids) for lp in y.logprobs]
        assert [lp.logprob for lp in x.logprobs] == pytest.approx([lp.logprob for lp in y.logprobs], abs=1e-6)
    assert a[2].logprobs is None
    runner = overlapped.engine.runner
    assert runner.num_ahead_used == runner.num_launched_ahead > 10


def test_cascade_graphs_replay_for_a_shared_prefix_with_transformers_tokens(checkpoints, hf_reference):
    """Requests on a cached 96-token prefix replay the cascade graph of their size (the shared length read
    from a device buffer at replay), in fp32 with transformers' tokens; a batch that shares nothing replays
    the plain graphs."""
    from affinity_serve.engine import SamplingParams

    path = checkpoints["llama"]
    llm = _llm(path, "float32")
    graphs = llm.engine.runner.decode_graphs
    rng = random.Random(7)
    prefix = [rng.randrange(10, 700) for _ in range(96)]
    llm.generate([prefix + [5]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    prompts = [prefix + [rng.randrange(10, 700) for _ in range(rng.randint(1, 20))] for _ in range(11)]
    params = [SamplingParams(max_tokens=6 + 2 * i, **GREEDY) for i in range(11)]
    before = graphs.num_cascade_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 6 + 2 * i) for i, p in enumerate(prompts)]
    assert graphs.num_cascade_steps - before >= 10 and graphs.num_graph_replays == graphs.num_steps
    cascaded = graphs.num_cascade_steps
    llm.generate(_prompts(6, seed=8), SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert graphs.num_cascade_steps == cascaded
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
