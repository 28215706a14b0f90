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
