"""Sliding-window attention in the KV manager (vLLM v1's hybrid KV cache): per-group tables, blocks a window has
passed freed as a request advances, prefix hits that need only the window's blocks, every block back after
finish / abort / preemption; and Mistral / Gemma 3 token-exact against transformers past their windows."""
import random

import pytest
import torch

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.attention.base import build_attention_metadata
from affinity_serve.engine.attention.flash import flash_kwargs
from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_groups import (KVCacheGroupSpec, blocks_needed, kv_cache_groups, kv_tensor_of_layer,
                                             num_kv_tensors)
from affinity_serve.engine.scheduler import Scheduler
from tests.unit.engine.helpers import assert_all_blocks_free, make_request, run_to_completion, step
from tests.unit.engine.tiny_hf import write_tiny_hf

WINDOW = 16


# ---------------------------------------------------------------- groups
def test_groups_follow_vllm_hybrid_layout():
    g = kv_cache_groups([None, 64, 64, 64, 64, 64, None, 64])        # Gemma-3-like: 2 full, 6 sliding layers
    assert g == [KVCacheGroupSpec((0, 6), None), KVCacheGroupSpec((1, 2), 64), KVCacheGroupSpec((3, 4), 64),
                 KVCacheGroupSpec((5, 7), 64)]
    assert num_kv_tensors(g) == 2                     # a block id is 2 layers' pages, of whichever group holds it
    assert kv_tensor_of_layer(g, 8) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 1), (3, 1)]
    assert kv_cache_groups([None] * 3) == [KVCacheGroupSpec((0, 1, 2), None)]      # plain models: as before
    assert kv_cache_groups([32] * 2) == [KVCacheGroupSpec((0, 1), 32)]             # Mistral: one sliding group


# ---------------------------------------------------------------- the manager alone
def _hybrid(num_blocks=64, window=WINDOW, max_chunk=None):
    groups = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), window)]
    return KVCacheManager(num_blocks, 4, 1024, groups=groups, enable_kv_cache_events=True,
                          max_chunk_tokens=max_chunk)


def _advance(kv, req, n):
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.cache_blocks(req, req.num_computed_tokens)


def test_sliding_group_drops_blocks_its_window_has_passed():
    kv = _hybrid()
    req = make_request("a", 100)
    for n in [24] * 4 + [4]:                            # chunked prefill of 100 tokens
        _advance(kv, req, n)
    full, sliding = kv.req_to_group_blocks["a"]
    assert len(full) == len(sliding) == 25 and not any(b.is_null for b in full)
    # the next query (position 100) reads from position 85 (block 21) on: blocks 0-20 are freed
    assert [b.is_null for b in sliding] == [True] * 21 + [False] * 4
    assert kv.num_held_blocks("a") == 25 + 4
    free_before = kv.pool.num_free_blocks
    kv.free(req)
    assert kv.pool.num_free_blocks == free_before + 29 == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_hit_needs_only_the_window_blocks_of_sliding_groups():
    kv = _hybrid()
    a = make_request("a", 64)
    _advance(kv, a, 64)
    kv.free(a)                                          # cached, free: hits while not evicted
    b = make_request("b", a.prompt_token_ids + [7] * 9)  # 73 tokens: 16 full blocks could hit
    hits, n = kv.get_computed_blocks(b)
    assert n == 64 and len(hits) == 16
    # evict an early sliding block (outside the window at the hit point): the hit stays whole
    early = kv.pool.get_cached_block(a.block_hashes[2], 1)
    kv.pool.touch([early])
    kv.pool.free_blocks([early])
    kv.pool._evict(early)
    assert kv.get_computed_blocks(b)[1] == 64
    # evict a sliding block inside the window at 64 (block 13): the hit shrinks below it
    inside = kv.pool.get_cached_block(a.block_hashes[13], 1)
    kv.pool._evict(inside)
    hits, n = kv.get_computed_blocks(b)
    assert n == 13 * 4 and kv.allocate_slots(b, 73 - n, hits) is not None
    sliding = kv.req_to_group_blocks["b"][1]
    assert [b.is_null for b in sliding[:13]] == [True] * 9 + [False] * 4      # window at 52 reads from block 9
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


def test_new_blocks_never_evict_another_groups_hits():
    """A full pool whose LRU head is the sliding group's hit blocks: group 0's new blocks must come from
    elsewhere (every group's hits are taken before any new block)."""
    kv = _hybrid(num_blocks=21)                          # 20 usable: exactly what `a` used over its life
    a = make_request("a", 40)
    for n in (12, 12, 12, 4):
        _advance(kv, a, n)
    kv.free(a)
    assert kv.pool.num_free_blocks == 20
    b = make_request("b", a.prompt_token_ids + [9] * 12)
    hits, n = kv.get_computed_blocks(b)
    assert n == 40
    window_hits = [kv.pool.get_cached_block(a.block_hashes[i], 1) for i in range(6, 10)]
    others = [blk for blk in kv.pool.free_queue if blk not in window_hits]
    kv.pool.touch(others)
    kv.pool.free_blocks(others)                          # now the sliding group's hits head the LRU queue
    assert set(map(id, list(kv.pool.free_queue)[:4])) == set(map(id, window_hits))
    assert kv.allocate_slots(b, 12, hits) is not None
    held = [blk for t in kv.req_to_group_blocks["b"] for blk in t if not blk.is_null]
    assert len(held) == len(set(map(id, held))) == 13 + 7 and all(blk.ref_cnt == 1 for blk in held)
    assert kv.req_to_group_blocks["b"][1][6:10] == window_hits
    kv.free(b)
    assert kv.pool.num_free_blocks == 20


def test_each_sliding_group_checks_its_own_window():
    groups = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), 8), KVCacheGroupSpec((2,), 32)]
    kv = KVCacheManager(64, 4, 1024, groups=groups)
    a = make_request("a", 64)
    _advance(kv, a, 64)
    kv.free(a)
    b = make_request("b", a.prompt_token_ids + [3])
    assert kv.get_computed_blocks(b)[1] == 64
    # block 10 is outside the 8-token window at 64 but inside the 32-token one: the hit ends before it
    kv.pool._evict(kv.pool.get_cached_block(a.block_hashes[10], 1))
    assert kv.get_computed_blocks(b)[1] == 64
    kv.pool._evict(kv.pool.get_cached_block(a.block_hashes[10], 2))
    assert kv.get_computed_blocks(b)[1] == 40


def test_full_group_miss_limits_the_hit():
    kv = _hybrid()
    a = make_request("a", 40)
    _advance(kv, a, 40)
    kv.free(a)
    kv.pool._evict(kv.pool.get_cached_block(a.block_hashes[3], 0))
    b = make_request("b", a.prompt_token_ids + [5])
    assert kv.get_computed_blocks(b)[1] == 3 * 4


def test_capacity_counts_only_the_window_for_sliding_groups():
    groups = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1, 2), 64)]
    # 8k tokens in 16-token blocks, one-block chunks (decode): full 512 blocks, sliding 64 / 16 + 1
    assert blocks_needed(groups, 8192, 16, max_chunk_tokens=1) == 512 + 5
    assert blocks_needed(groups, 8192, 16) == 1024                # one 8k chunk needs every block at once
    # 40 usable blocks, window 16 and 8-token chunks in 4-token blocks: the sliding group holds 7 at most
    assert _hybrid(num_blocks=41, max_chunk=8).max_tokens_capacity() == 4 * (40 - 7)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduler_returns_every_block_after_finish_abort_and_preemption(policy):
    """A pool too small for all requests at once: preemptions, chunked prefill past the window, an abort;
    sliding tables never hold a block their window has passed (one block of lag), and every block is back."""
    kv = _hybrid(num_blocks=40, max_chunk=12)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6, policy=policy), kv, 1024)
    rng = random.Random(3)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", rng.randint(10, 60), max_tokens=rng.randint(5, 30),
                                       priority=i % 2))
    preempted = 0
    for n in range(2000):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched)
        preempted += len(so.preempted_req_ids)
        assert so.kv_group_block_ids is not None and set(so.kv_group_block_ids) == set(so.num_scheduled_tokens)
        for rid, (full, sliding) in so.kv_group_block_ids.items():
            req = sched.requests.get(rid)
            if req is None:
                continue
            start = max(0, req.num_computed_tokens - so.num_scheduled_tokens[rid] - WINDOW + 1) // 4
            assert len(full) == len(sliding) and 0 not in full
            assert all(b == 0 for b in sliding[:max(start - 1, 0)]) and 0 not in sliding[start:]
        if n == 5:
            sched.abort_requests("r1")
    assert preempted > 0, "the pool was meant to force preemptions"
    assert_all_blocks_free(sched)
    assert not kv.req_to_group_blocks


def test_scheduler_without_windows_is_unchanged():
    kv = KVCacheManager(64, 4, 256)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, 256)
    sched.add_request(make_request("a", 20))
    so, _ = step(sched)
    assert so.kv_group_block_ids is None and not kv.windowed
    run_to_completion(sched)
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------- attention input preparation
def test_window_metadata_for_flash_and_torch():
    """The GPU path's input preparation (tested here on CPU): whole tables with null blocks where the window
    has passed, no cascade, and flash-attn's window_size = (window - 1, 0)."""
    meta = build_attention_metadata([40, 3], [1, 9], [[0, 0, 0, 0, 0, 0, 7, 8, 9, 10, 11], [4, 5, 6]], 4,
                                    sliding_window=WINDOW)
    assert meta.sliding_window == WINDOW and meta.num_common_prefix_blocks == 0
    assert meta.block_tables[0, :6].tolist() == [0] * 6
    kw = flash_kwargs(meta, 0.5, None)
    assert kw["window_size"] == (WINDOW - 1, 0) and kw["softcap"] == 0.0 and kw["causal"]
    assert flash_kwargs(build_attention_metadata([3], [1], [[1]], 4), 0.5, 30.0)["window_size"] == (-1, -1)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_torch_window_attention_matches_a_dense_reference(softcap):
    """Decode and chunked prefill under a window, through tables whose passed entries are null (block 0
    holds garbage): equal to dense masked attention over the real keys."""
    torch.manual_seed(0)
    bs, kvh, heads, d, nb = 4, 2, 4, 8, 40
    backend = TorchPagedAttention(cpu_kernels=False)
    cache = torch.randn(backend.kv_cache_shape(nb, bs, kvh, d)) * 100          # garbage everywhere, block 0 too
    lens, starts = [41, 23, 30], [40, 22, 18]                                  # two decodes, one 12-token chunk
    tables = [list(range(1, 12)), list(range(12, 18)), list(range(20, 28))]
    keys = {i: (torch.randn(n, kvh, d), torch.randn(n, kvh, d)) for i, n in enumerate(lens)}
    for i, t in enumerate(tables):                          # cached context written through the tables
        k, v = keys[i]
        for p in range(starts[i]):
            cache[0, :, t[p // bs], p % bs] = k[p]
            cache[1, :, t[p // bs], p % bs] = v[p]
    nulled = [[0 if j < max(0, s - WINDOW + 1) // bs else b for j, b in enumerate(t)] for t, s in zip(tables, starts)]
    meta = build_attention_metadata(starts, [n - s for n, s in zip(lens, starts)], nulled, bs, sliding_window=WINDOW)
    q = torch.randn(meta.num_tokens, heads, d)
    k_new = torch.cat([keys[i][0][starts[i]:] for i in range(3)])
    v_new = torch.cat([keys[i][1][starts[i]:] for i in range(3)])
    out = backend.forward(q, k_new, v_new, cache, meta, 0.3, softcap)
    row = 0
    for i in range(3):
        k, v = keys[i]
        for p in range(starts[i], lens[i]):
            kk = k[:p + 1].repeat_interleave(heads // kvh, 1)                # [p+1, H, D]
            s = torch.einsum("hd,khd->hk", q[row], kk.float()) * 0.3
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s[:, :max(0, p - WINDOW + 1)] = float("-inf")
            ref = torch.einsum("hk,khd->hd", s.softmax(-1), v[:p + 1].repeat_interleave(heads // kvh, 1))
            torch.testing.assert_close(out[row], ref, atol=1e-4, rtol=1e-4)
            row += 1


def test_decode_inside_the_window_reads_like_full_attention():
    """Until a request outgrows its window, windowed decode is full attention (and may take the C kernel)."""
    torch.manual_seed(1)
    bs, kvh, heads, d = 4, 2, 4, 8
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(16, bs, kvh, d))
    tables, lens = [[1, 2, 3, 4], [5, 6, 7]], [15, 9]
    q, k, v = torch.randn(2, heads, d), torch.randn(2, kvh, d), torch.randn(2, kvh, d)
    outs = []
    for window in (None, 64):
        meta = build_attention_metadata([n - 1 for n in lens], [1, 1], tables, bs, sliding_window=window)
        outs.append(TorchPagedAttention().forward(q, k, v, cache.clone(), meta, 0.3))
    torch.testing.assert_close(outs[0], outs[1])


# ---------------------------------------------------------------- token-exact against transformers
@pytest.fixture(scope="module")
def tiny_sliding(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_sliding")
    return {
        "mistral": str(write_tiny_hf(root / "mistral", "MistralConfig", seed=11, sliding_window=WINDOW)),
        "gemma3": str(write_tiny_hf(root / "gemma3", "Gemma3TextConfig", seed=22, num_hidden_layers=3, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    }


def _prompts(n, lo, hi, seed, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(10, 700) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _generate(llm, prompts, n):
    # min_tokens masks EOS as transformers' min_new_tokens does (ignore_eos would let it be sampled, and unmask it)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _full_attention_reference(hf_reference, path, prompts, n):
    """transformers with the window switched off: proves the prompts are long enough for it to matter."""
    model = hf_reference.model(path)
    saved = model.config.sliding_window
    model.config.sliding_window = 10 ** 6
    try:
        return [hf_reference(path, p, n) for p in prompts]
    finally:
        model.config.sliding_window = saved


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_matches_transformers_past_the_window(tiny_sliding, hf_reference, name):
    path = tiny_sliding[name]
    prompts = _prompts(4, 20, 70, seed=1)
    llm = LLM(path, cache={"num_blocks": 96, "block_size": 8}, scheduler={"max_num_batched_tokens": 24})
    assert llm.engine.max_model_len == 512                   # full context, no cap at the window
    got = _generate(llm, prompts, 24)
    want = [hf_reference(path, p, 24) for p in prompts]
    assert got == want
    assert len({t for ids in got for t in ids}) > 3, "degenerate output proves little"
    assert want != _full_attention_reference(hf_reference, path, prompts, 24)
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("num_blocks", [26, 200], ids=["preempting", "roomy"])
def test_preemption_and_prefix_hits_past_the_window_stay_exact(tiny_sliding, hf_reference, num_blocks):
    """Prompts sharing a 40-token prefix (past the 16-token window) after a request that cached it: exact in a
    pool that forces preemption and in a roomy one, where every request hits the whole prefix (the sliding
    groups needed only its last window's blocks); every block is back at the end."""
    path = tiny_sliding["gemma3"]
    shared = _prompts(1, 40, 40, seed=7)[0]
    llm = LLM(path, cache={"num_blocks": num_blocks, "block_size": 8}, scheduler={"max_num_batched_tokens": 32})
    first = _generate(llm, [shared + [11, 12, 13]], 4)
    prompts = _prompts(5, 8, 18, seed=8, prefix=shared)
    got = _generate(llm, prompts, 24)
    assert first == [hf_reference(path, shared + [11, 12, 13], 4)]
    assert got == [hf_reference(path, p, 24) for p in prompts]
    kv = llm.engine.kv_cache_manager
    if num_blocks == 26:
        assert llm.engine.scheduler._num_preemptions > 0, "the pool was meant to force preemptions"
    else:
        assert kv.stats.requests == 6 and kv.stats.hits == 5 * 40
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1 and not kv.req_to_group_blocks
