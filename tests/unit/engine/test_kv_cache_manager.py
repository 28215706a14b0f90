from affinity_serve.engine.kv_cache_manager import KVCacheManager

from tests.unit.engine.helpers import make_request


def _compute(kv, req, n):
    """Pretend the runner computed `n` more tokens of `req`."""
    req.num_computed_tokens += n
    kv.cache_blocks(req, req.num_computed_tokens)


def test_hit_never_covers_last_token():
    kv = KVCacheManager(32, 4, 128)
    a = make_request("a", list(range(1, 9)))            # exactly 2 blocks
    assert kv.allocate_slots(a, 8) is not None
    _compute(kv, a, 8)
    b = make_request("b", list(range(1, 9)))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and len(blocks) == 1                  # the last block is recomputed for logits
    c = make_request("c", list(range(1, 10)))           # 9 tokens: both full blocks may hit
    assert kv.get_computed_blocks(c)[1] == 8


def test_allocate_none_has_no_side_effects():
    kv = KVCacheManager(4, 4, 128)                      # 3 usable blocks
    a = make_request("a", 8)
    assert len(kv.allocate_slots(a, 8)) == 2
    _compute(kv, a, 8)
    b = make_request("b", a.prompt_token_ids + [9, 9, 9, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    before = (kv.pool.num_free_blocks, [x.ref_cnt for x in kv.pool.blocks], dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 13 - 8 + 4, hits) is None   # needs 2 new blocks, 1 free
    assert (kv.pool.num_free_blocks, [x.ref_cnt for x in kv.pool.blocks], dict(kv.req_to_blocks)) == before
    assert "b" not in kv.num_cached_block
    got = kv.allocate_slots(b, 4, hits)                     # a chunk that fits: 1 new block
    assert got is not None and len(got) == 1
    assert [x.ref_cnt for x in kv.req_to_blocks["b"][:2]] == [2, 2]


def test_free_cached_hit_blocks_count_against_capacity():
    kv = KVCacheManager(4, 4, 128)
    a = make_request("a", 9)
    kv.allocate_slots(a, 9)
    _compute(kv, a, 9)
    kv.free(a)                                          # 3 free blocks, 2 of them cached
    b = make_request("b", a.prompt_token_ids[:8] + [5, 5, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 3 + 4, hits) is None    # 2 hits leave the queue + 2 new > 3 free
    assert kv.pool.num_free_blocks == 3
    assert len(kv.allocate_slots(b, 3, hits)) == 1      # 2 hits + 1 new == 3 free
    assert kv.pool.num_free_blocks == 0


def test_salt_isolation():
    kv = KVCacheManager(32, 4, 128)
    a = make_request("a", list(range(1, 10)), cache_salt="t1")
    kv.allocate_slots(a, 9)
    _compute(kv, a, 9)
    same = make_request("b", list(range(1, 10)), cache_salt="t1")
    other = make_request("c", list(range(1, 10)), cache_salt="t2")
    none = make_request("d", list(range(1, 10)))
    assert kv.get_computed_blocks(same)[1] == 8
    assert kv.get_computed_blocks(other)[1] == 0
    assert kv.get_computed_blocks(none)[1] == 0


def test_reset_and_epoch():
    kv = KVCacheManager(8, 4, 128)
    a = make_request("a", 9)
    kv.allocate_slots(a, 9)
    _compute(kv, a, 9)
    assert kv.reset_prefix_cache() is False and kv.cache_epoch == 0
    kv.free(a)
    assert kv.reset_prefix_cache() is True and kv.cache_epoch == 1
    assert kv.get_computed_blocks(make_request("b", a.prompt_token_ids))[1] == 0


def test_blocks_only_cached_after_compute():
    kv = KVCacheManager(8, 4, 128)
    a = make_request("a", 9)
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", a.prompt_token_ids))[1] == 0
    _compute(kv, a, 5)
    assert kv.get_computed_blocks(make_request("c", a.prompt_token_ids))[1] == 4


def test_recent_prefix_cache_window_slides_and_resets():
    kv = KVCacheManager(32, 4, 128, recent_requests=3)
    for i, (queries, hits) in enumerate([(10, 8), (20, 0), (30, 12), (40, 40)]):
        kv.record_admission(make_request(f"r{i}", queries), hits)
    assert (kv.stats.queries, kv.stats.hits) == (100, 60)                   # lifetime totals
    assert (kv.recent.queries, kv.recent.hits) == (20 + 30 + 40, 0 + 12 + 40)  # the last 3 admissions
    assert kv.reset_prefix_cache()
    assert (kv.recent.queries, kv.recent.hits) == (0, 0)
    assert (kv.stats.queries, kv.stats.hits) == (100, 60)                   # totals stay cumulative
    kv.record_admission(make_request("r9", 8), 4)
    assert (kv.recent.queries, kv.recent.hits) == (8, 4)


def test_recent_window_kept_when_reset_is_refused():
    kv = KVCacheManager(32, 4, 128)
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    kv.record_admission(a, 0)
    assert not kv.reset_prefix_cache()              # a block is held: nothing was reset
    assert (kv.recent.queries, kv.recent.hits) == (8, 0)
