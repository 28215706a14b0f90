"""Greedy output token-exact against transformers when prefixes come from a KV tier (offload, shared
store, mixed with local hits), through chunked prefill and preemption; isolation of the shared store."""
from __future__ import annotations

import multiprocessing as mp
import random

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.kv_connector import KVLayout, SharedKVStore

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS = 8


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _llm(path, connector, num_blocks=14, events=False, **kw):
    return LLM(path, cache={"num_blocks": num_blocks, "block_size": BS, "enable_kv_cache_events": events},
               kv_connector=connector, **kw)


def _gen(llm, prompts, n=6):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _flush(llm):
    """Let the last step's stores reach the tier (the serving loop keeps stepping for them)."""
    for _ in range(10):
        if not llm.engine.has_unfinished_requests():
            return
        llm.engine.step()
    raise AssertionError("KV transfers did not finish")


def _evict(llm, seed):
    """Fill the small pool with unrelated prompts so earlier prefixes leave it."""
    _gen(llm, [_ids(60, seed + i) for i in range(2)], n=2)


@pytest.mark.parametrize("store_on", ["evict", "finish"])
def test_offload_tier_serves_an_evicted_prefix_token_exact(checkpoints, hf_reference, store_on, tmp_path):
    path = checkpoints["llama"]
    llm = _llm(path, {"type": "offload", "capacity_blocks": 64, "store_on": store_on})
    prefix = _ids(56, 1)
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    assert _gen(llm, [a])[0] == [hf_reference(path, a, 6)]
    _evict(llm, 100)
    hashes = llm.engine.scheduler.kv.pool.cached
    assert not set(hash_block_chain(prefix, BS)) & set(hashes), "the prefix was meant to leave the pool"
    toks, cached = _gen(llm, [b])
    assert toks == [hf_reference(path, b, 6)]
    assert cached == [56]                                # all 7 prefix blocks came back from the tier
    stats = llm.engine.kv_connector.stats
    assert stats.loads_ok >= 1 and stats.loaded_blocks >= 7 and stats.loads_failed == 0
    _flush(llm)
    llm.engine.kv_connector.check_accounting()
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == llm.engine.num_blocks - 1


def test_offload_tier_with_chunked_prefill_and_preemption(checkpoints, hf_reference):
    path = checkpoints["qwen2"]
    llm = _llm(path, {"type": "offload", "capacity_blocks": 128}, num_blocks=20,
               scheduler={"max_num_batched_tokens": 24, "long_prefill_token_threshold": 16})
    prefixes = [_ids(40, 10 + i) for i in range(3)]
    prompts = [p + _ids(5, 20 + j * 3 + i) for j in range(2) for i, p in enumerate(prefixes)]
    refs = [hf_reference(path, p, 10) for p in prompts]
    first = llm.generate(prompts[:3], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == refs[:3]
    outs = llm.generate(prompts[3:], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs[3:]
    sched = llm.engine.scheduler
    assert sched._num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert llm.engine.kv_connector.stats.loads_ok > 0
    _flush(llm)
    assert sched.kv.pool.num_free_blocks == llm.engine.num_blocks - 1 and not sched.held_blocks()


def test_shared_store_serves_another_engines_prefix_mixed_with_local_hits(checkpoints, hf_reference, tmp_path):
    path = checkpoints["llama"]
    cfg = {"type": "shared", "capacity_blocks": 256, "shared_dir": str(tmp_path)}
    a_eng, b_eng = _llm(path, cfg, num_blocks=32, events=True), _llm(path, cfg, num_blocks=32)
    prefix = _ids(64, 3)
    _gen(a_eng, [prefix + [1, 2, 3]])
    _flush(a_eng)
    stored = [h for e in a_eng.engine.take_kv_events() if type(e).__name__ == "BlockStored" and e.medium == "shared"
              for h in e.block_hashes]
    assert stored[:8] == hash_block_chain(prefix, BS)         # A reports what it put in the store
    _gen(b_eng, [prefix[:24] + [9, 9, 9]])             # B now holds the first 3 blocks in its pool
    loaded_before = b_eng.engine.kv_connector.stats.loaded_blocks
    p = prefix + [4, 5]
    toks, cached = _gen(b_eng, [p])
    assert toks == [hf_reference(path, p, 6)] and cached == [64]
    assert b_eng.engine.kv_connector.stats.loaded_blocks - loaded_before == 5   # blocks 3..7 loaded, 0..2 local


def test_shared_store_isolation_model_dtype_and_salt(checkpoints, hf_reference, tmp_path):
    cfg = {"type": "shared", "capacity_blocks": 256, "shared_dir": str(tmp_path)}
    prefix = _ids(48, 4)
    writer = _llm(checkpoints["llama"], cfg, num_blocks=32)
    _gen(writer, [prefix + [1]])
    _flush(writer)
    other_model = _llm(checkpoints["mistral"], cfg, num_blocks=32)       # same shapes, other weights
    p = prefix + [2]
    toks, cached = _gen(other_model, [p])
    assert cached == [0] and toks == [hf_reference(checkpoints["mistral"], p, 6)]
    other_dtype = _llm(checkpoints["llama"], cfg, num_blocks=32, dtype="bfloat16")
    _, cached = _gen(other_dtype, [p])
    assert cached == [0]
    same = _llm(checkpoints["llama"], cfg, num_blocks=32)
    eng = same.engine
    eng.add_request(eng.make_request(p, SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-b", req_id="salted"))
    cached_salted = []
    while eng.has_unfinished_requests():
        cached_salted += [d.num_cached_tokens for d in eng.step().deltas]
    assert set(cached_salted) == {0}
    _, cached = _gen(same, [p])                          # unsalted: the writer's blocks
    assert cached == [48]


def _child_writes(path: str, shared_dir: str, prompt: list[int]) -> None:
    llm = _llm(path, {"type": "shared", "capacity_blocks": 256, "shared_dir": shared_dir}, num_blocks=32)
    llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    _flush(llm)


def test_second_process_loads_what_the_first_computed(checkpoints, hf_reference, tmp_path):
    path = checkpoints["llama"]
    prefix = _ids(40, 5)
    proc = mp.get_context("spawn").Process(target=_child_writes, args=(path, str(tmp_path), prefix + [1]))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    llm = _llm(path, {"type": "shared", "capacity_blocks": 256, "shared_dir": str(tmp_path)}, num_blocks=32)
    p = prefix + [7, 7]
    toks, cached = _gen(llm, [p])
    assert cached == [40] and toks == [hf_reference(path, p, 6)]


def test_shared_store_capacity_eviction_and_accounting(tmp_path):
    layout = KVLayout(2, 2, 8, 4, "float32", 4)
    store = SharedKVStore(str(tmp_path), layout.namespace("m"), layout.block_bytes, capacity_blocks=10)
    blocks = [(bytes([i]) * 32, memoryview(bytes([i]) * layout.block_bytes)) for i in range(25)]
    evicted_all = []
    for i in range(0, 25, 5):
        written, evicted = store.write_many(blocks[i:i + 5])
        assert len(written) == 5
        evicted_all += evicted
        assert store.num_blocks() == len(store.block_hashes()) <= 10
    assert set(evicted_all) | set(store.block_hashes()) == {h for h, _ in blocks}
    assert not set(evicted_all) & set(store.block_hashes())
    buf = bytearray(layout.block_bytes)
    h24 = blocks[24][0]
    assert store.read_into(h24, memoryview(buf)) and bytes(buf) == bytes([24]) * layout.block_bytes
    assert not store.read_into(blocks[0][0], memoryview(buf))
    assert store.write_many([blocks[24]]) == ([], [])          # present already: not rewritten
    other = SharedKVStore(str(tmp_path), layout.namespace("other-model"), layout.block_bytes, 10)
    assert not other.contains(h24)
