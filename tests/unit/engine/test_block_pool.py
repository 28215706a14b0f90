import pytest

from affinity_serve.engine.block_pool import BlockPool
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.types import AllBlocksCleared, BlockRemoved, BlockStored


def test_null_block_reserved_and_usage():
    pool = BlockPool(5, 4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.usage == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4


def test_lru_order_and_reverse_free():
    pool = BlockPool(6, 4)
    a = pool.get_new_blocks(3)            # 1 2 3
    pool.free_blocks(reversed(a))         # a request frees tail first: queue 4 5 3 2 1
    order = [b.block_id for b in pool.free_queue]
    assert order == [4, 5, 3, 2, 1]


def test_touch_removes_free_cached_block_and_eviction_drops_hash():
    pool = BlockPool(4, 2, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    hashes = hash_block_chain([1, 2, 3, 4], 2)
    pool.cache_full_blocks(blocks, hashes, [1, 2, 3, 4], 0, 2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))    # queue: 3, b2, b1
    hit = pool.get_cached_block(hashes[0])
    pool.touch([hit])                     # O(1) removal from the middle of the free queue
    assert hit.ref_cnt == 1 and [b.block_id for b in pool.free_queue] == [3, blocks[1].block_id]
    new = pool.get_new_blocks(2)          # evicts block 3 (no hash) then blocks[1] (hash dropped)
    assert blocks[1] in new and pool.get_cached_block(hashes[1]) is None
    assert new[1].block_hash is None
    events = pool.take_events()
    assert isinstance(events[0], BlockStored) and events[0].block_hashes == hashes
    assert events[0].parent_block_hash is None and events[0].token_ids == [1, 2, 3, 4]
    assert events[-1] == BlockRemoved([hashes[1]])
    assert pool.take_events() == []


def test_duplicate_hashes_allowed():
    pool = BlockPool(4, 2)
    h = hash_block_chain([7, 7], 2)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], h, [7, 7], 0, 1)
    pool.cache_full_blocks([b2], h, [7, 7], 0, 1)
    assert pool.cached_blocks(h[0]) == [b1, b2]
    pool.free_blocks([b1])
    pool.get_new_blocks(2)                # evicts the free spare block 3, then b1
    assert pool.get_cached_block(h[0]) is b2 and pool.cached_blocks(h[0]) == [b2]
    pool.free_blocks([b2])
    pool.get_new_blocks(1)                # evicts b2: nothing is left under the hash
    assert pool.get_cached_block(h[0]) is None and not pool.cached


def test_reset_refuses_while_in_use():
    pool = BlockPool(4, 2, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, hash_block_chain([1, 2], 2), [1, 2], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(b)
    assert pool.reset_prefix_cache() is True
    assert not pool.cached and all(x.block_hash is None for x in pool.blocks)
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)
