"""KV connectors for hybrid models (sliding-window KV-cache groups): the offload tier and the node-shared store
keep each group's blocks under the pool's cache keys, a load fills every full-attention block and only the
blocks a sliding window reads; greedy output token-exact against transformers with prefixes from the tier,
every block back at the end. Tiny Gemma 3 (sliding, full, sliding layers: three groups) and Mistral (every
layer sliding: one group)."""
from __future__ import annotations

import random

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.block_pool import cache_key
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.kv_connector import model_kv_layout
from affinity_serve.engine.kv_connector.base import tier_hit_end
from tests.unit.engine.tiny_hf import write_tiny_hf

WINDOW = 16
BS = 8


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hybrid")
    return {
        "gemma3": str(write_tiny_hf(root / "gemma3", "Gemma3TextConfig", seed=22, num_hidden_layers=3, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        "mistral": str(write_tiny_hf(root / "mistral", "MistralConfig", seed=11, sliding_window=WINDOW)),
    }


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _llm(path, connector, num_blocks=40, **kw):
    return LLM(path, cache={"num_blocks": num_blocks, "block_size": BS}, kv_connector=connector,
               scheduler={"max_num_batched_tokens": 32}, **kw)


def _gen(llm, prompts, n=8):
    # min_tokens masks EOS as transformers' min_new_tokens does
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _drain(llm):
    for _ in range(20):
        if not llm.engine.has_unfinished_requests():
            return
        llm.engine.step()
    raise AssertionError("KV transfers did not finish")


def _evict(llm, seed):
    """Unrelated prompts through the small pool, so earlier prefixes leave it (every group's blocks)."""
    for i in range(6):
        _gen(llm, [_ids(60, seed + i)], n=2)


def _assert_all_back(llm):
    _drain(llm)
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not llm.engine.kv_cache_manager.req_to_group_blocks


# ---------------------------------------------------------------- the layout and the hit rule
def test_layout_is_one_entry_per_shared_kv_tensor_with_each_groups_window():
    plain = model_kv_layout([None] * 4, 2, 16, 8, "float32", 4)
    assert plain.num_layers == 4 and plain.kv_groups == ()
    gemma = model_kv_layout([16, None, 16], 2, 16, 8, "float32", 4)       # groups: full (1,), (0,), (2,)
    assert gemma.num_layers == 1 and gemma.kv_groups == (None, 16, 16)
    assert gemma.block_bytes == 2 * 1 * 2 * 8 * 16 * 4                   # one pool block id's pages
    assert gemma.namespace("m") != model_kv_layout([16, 16, 16], 2, 16, 8, "float32", 4).namespace("m")


def test_tier_hit_needs_full_blocks_and_only_the_sliding_window():
    hashes = [bytes([i]) * 32 for i in range(10)]
    windows = (None, 16)                                                  # 16 tokens = 2 blocks of 8
    held = {cache_key(h, 0) for h in hashes} | {cache_key(hashes[i], 1) for i in (0, 1, 2, 5, 6, 7, 8, 9)}
    assert cache_key(hashes[3], 1) == (1, hashes[3])

    def end(start=0):
        return tier_hit_end(hashes, start, 9, windows, held.__contains__, 8)
    # a hit to block 9 (token 72 next): the window reads tokens 57.. = blocks 7, 8; sliding 3, 4 not needed
    assert end() == 9
    held.discard(cache_key(hashes[8], 1))     # in that window: the hit ends at 8, whose window (6, 7) is held
    assert end() == 8
    held.discard(cache_key(hashes[3], 0))     # a full group's gap stops it at 3 (window: blocks 1, 2)
    assert end() == 3
    assert end(start=3) == 3                  # nothing beyond a local hit of 3 blocks


# ---------------------------------------------------------------- token-exact with a tier
@pytest.mark.parametrize("store_on", ["evict", "finish"])
@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_offload_serves_a_prefix_past_the_window_token_exact(tiny_hybrid, hf_reference, name, store_on):
    """`evict`: the tier gets every group's blocks as the pool reuses them, so a prompt sharing any prefix of
    an earlier one loads it. `finish`: it gets what the request holds when it ends, a sliding group's last
    window only, so the hit is the next turn of that conversation (the earlier prompt and its output)."""
    path = tiny_hybrid[name]
    llm = _llm(path, {"type": "offload", "capacity_blocks": 256, "store_on": store_on})
    prefix = _ids(56, 1)                                 # 7 blocks, past the 16-token window
    a = prefix + [11, 12, 13]
    out_a = _gen(llm, [a])[0][0]
    assert out_a == hf_reference(path, a, 8)
    # evict: a new prompt on the 56-token prefix; finish: the conversation so far (67 tokens: 8 full blocks)
    b = prefix + [21, 22] if store_on == "evict" else a + out_a + [21, 22]
    num_hit = 56 if store_on == "evict" else 64
    _evict(llm, 100)
    pool = llm.engine.kv_cache_manager.pool
    assert not set(hash_block_chain(b, BS)) & set(pool.cached), "the prefix was meant to leave the pool"
    toks, cached = _gen(llm, [b])
    assert toks == [hf_reference(path, b, 8)]
    assert cached == [num_hit]                           # the whole prefix came back from the tier
    stats = llm.engine.kv_connector.stats
    assert stats.loads_ok == 1 and stats.loads_failed == 0
    windows = llm.engine.kv_connector.layout.kv_groups
    # full groups load every block; a sliding group only the 2 its 16-token window reads at the hit's end
    assert stats.loaded_blocks == sum(num_hit // BS if w is None else 2 for w in windows)
    _assert_all_back(llm)
    llm.engine.kv_connector.check_accounting()


def test_offload_with_chunked_prefill_preemption_and_local_hits(tiny_hybrid, hf_reference):
    """Several prefixes through a pool too small for the batch (preemptions), some prefixes still local, some
    in the tier: every output exact, every block and slot back."""
    path = tiny_hybrid["gemma3"]
    llm = LLM(path, cache={"num_blocks": 34, "block_size": BS},
              kv_connector={"type": "offload", "capacity_blocks": 200},
              scheduler={"max_num_batched_tokens": 24, "long_prefill_token_threshold": 16})
    prefixes = [_ids(40, 10 + i) for i in range(3)]
    prompts = [p + _ids(5, 20 + j * 3 + i) for j in range(2) for i, p in enumerate(prefixes)]
    refs = [hf_reference(path, p, 10) for p in prompts]
    first = _gen(llm, prompts[:3], n=10)[0]
    second = _gen(llm, prompts[3:], n=10)[0]
    assert first + second == refs
    assert llm.engine.scheduler._num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert llm.engine.kv_connector.stats.loads_ok > 0
    _assert_all_back(llm)
    llm.engine.kv_connector.check_accounting()


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_shared_store_serves_another_replicas_prefix_token_exact(tiny_hybrid, hf_reference, name, tmp_path):
    """Replica A computes a prefix past the window; replica B (its own pool) loads it from the node's store:
    every group's blocks, in a namespace per group."""
    path = tiny_hybrid[name]
    conn = {"type": "shared", "shared_dir": str(tmp_path / "kv"), "capacity_blocks": 300}
    a_llm, b_llm = _llm(path, conn), _llm(path, conn)
    prefix = _ids(48, 3)
    a, b = prefix + [5, 6, 7], prefix + [8, 9]
    assert _gen(a_llm, [a])[0] == [hf_reference(path, a, 8)]
    _drain(a_llm)
    toks, cached = _gen(b_llm, [b])
    assert toks == [hf_reference(path, b, 8)]
    assert cached == [48]
    stats = b_llm.engine.kv_connector.stats
    windows = b_llm.engine.kv_connector.layout.kv_groups
    assert stats.loads_ok == 1 and stats.loaded_blocks == sum(6 if w is None else 2 for w in windows)
    store = b_llm.engine.kv_connector.store
    if len(windows) > 1:                          # a namespace per group; inspection reports group 0's hashes
        assert len(store.stores) == len(windows)
        assert set(store.block_hashes()) >= set(hash_block_chain(prefix, BS))
    _assert_all_back(a_llm)
    _assert_all_back(b_llm)
    a_llm.engine.kv_connector.close()
    b_llm.engine.kv_connector.close()


def test_tier_events_and_snapshots_name_only_group_0_hashes(tiny_hybrid):
    """The router indexes plain block hashes: another group's keys never reach KV events or snapshots."""
    path = tiny_hybrid["gemma3"]
    llm = LLM(path, cache={"num_blocks": 40, "block_size": BS, "enable_kv_cache_events": True},
              kv_connector={"type": "offload", "capacity_blocks": 8}, scheduler={"max_num_batched_tokens": 32})
    for i in range(4):                             # a small tier: stores and tier evictions both happen
        _gen(llm, [_ids(60, 200 + i)], n=2)
    _drain(llm)
    conn = llm.engine.kv_connector
    events = conn.take_events()
    assert events and conn.stats.evicted_blocks > 0
    for e in events:
        assert all(type(h) is bytes for h in e.block_hashes)
    assert all(type(h) is bytes for h in conn.block_hashes())
    assert any(type(k) is tuple for k in conn._index), "the tier was meant to hold sliding groups' blocks too"


def test_pd_connector_is_still_refused_for_hybrid_models(tiny_hybrid):
    with pytest.raises(ValueError, match="sliding-window layers"):
        LLM(tiny_hybrid["gemma3"], cache={"num_blocks": 40, "block_size": BS}, kv_connector={"type": "pd"})
