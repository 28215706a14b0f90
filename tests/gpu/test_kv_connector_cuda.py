"""KV connector tiers on CUDA (pinned host buffers, the side-stream copies): a prefix evicted from the GPU
pool comes back from the offload tier, and one replica loads what another computed from the node-shared
store, token-exact against transformers in float32. Skipped cleanly without CUDA."""
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS = 8


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _llm(path, connector, num_blocks=14):
    from affinity_serve.engine import LLM
    return LLM(path, device="cuda", dtype="float32", attention_backend="torch",
               cache={"num_blocks": num_blocks, "block_size": BS}, kv_connector=connector)


def _gen(llm, prompts, n=6):
    from affinity_serve.engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _drain(llm):
    for _ in range(10):
        if not llm.engine.has_unfinished_requests():
            return
        llm.engine.step()


def test_offload_tier_on_cuda_serves_an_evicted_prefix_token_exact(checkpoints, hf_reference):
    path = checkpoints["llama"]
    llm = _llm(path, {"type": "offload", "capacity_blocks": 64})
    prefix = _ids(56, 1)
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    assert _gen(llm, [a])[0] == [hf_reference(path, a, 6)]
    _gen(llm, [_ids(60, 100 + i) for i in range(2)], n=2)          # push the prefix out of the GPU pool
    toks, cached = _gen(llm, [b])
    assert toks == [hf_reference(path, b, 6)] and cached == [56]
    stats = llm.engine.kv_connector.stats
    assert stats.loads_ok >= 1 and stats.loads_failed == 0
    _drain(llm)
    llm.engine.kv_connector.check_accounting()
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == llm.engine.num_blocks - 1


def test_shared_store_on_cuda_loads_what_another_engine_computed(checkpoints, hf_reference, tmp_path):
    path = checkpoints["llama"]
    conn = {"type": "shared", "shared_dir": str(tmp_path / "store"), "capacity_blocks": 256}
    writer, reader = _llm(path, conn), _llm(path, conn)
    prefix = _ids(48, 7)
    a, b = prefix + [5, 6], prefix + [8, 9, 10]
    assert _gen(writer, [a])[0] == [hf_reference(path, a, 6)]
    _drain(writer)
    toks, cached = _gen(reader, [b])
    assert toks == [hf_reference(path, b, 6)] and cached == [48]
    assert reader.engine.kv_connector.stats.loaded_blocks >= 6


@pytest.mark.parametrize("connector", ["offload", "shared"])
def test_hybrid_model_tiers_on_cuda_token_exact(hf_reference, tmp_path, connector):
    """Issue 31: a sliding-window model's groups (tiny Gemma 3: one full, two sliding) through each tier on CUDA,
    the prefix past the window: exact, with a sliding group loading only its window's blocks."""
    from affinity_serve.engine import LLM
    from tests.unit.engine.tiny_hf import write_tiny_hf
    path = str(write_tiny_hf(tmp_path / "gemma3", "Gemma3TextConfig", seed=22, num_hidden_layers=3, head_dim=16,
                             query_pre_attn_scalar=24, sliding_window=16, tie_word_embeddings=True,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    conn = ({"type": "offload", "capacity_blocks": 256} if connector == "offload" else
            {"type": "shared", "shared_dir": str(tmp_path / "store"), "capacity_blocks": 300})

    def make():
        return LLM(path, device="cuda", dtype="float32", cache={"num_blocks": 40, "block_size": BS},
                   scheduler={"max_num_batched_tokens": 32}, kv_connector=conn)
    first = make()
    prefix = _ids(56, 1)
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    assert _gen(first, [a], n=8)[0] == [hf_reference(path, a, 8)]
    if connector == "offload":
        for i in range(6):                                           # every group's prefix blocks leave the pool
            _gen(first, [_ids(60, 100 + i)], n=2)
        second = first
    else:
        _drain(first)
        second = make()
    toks, cached = _gen(second, [b], n=8)
    assert toks == [hf_reference(path, b, 8)] and cached == [56]
    stats = second.engine.kv_connector.stats
    assert stats.loads_ok == 1 and stats.loaded_blocks == 7 + 2 + 2     # full group: 7; each sliding group: 2
    _drain(second)
    assert second.engine.kv_cache_manager.pool.num_free_blocks == second.engine.num_blocks - 1
