"""BlockPool: the fixed set of KV blocks, their ref counts, the LRU free queue and the hash -> block map."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


#: a block's key in the pool (and in a KV tier): its hash in group 0, (group, hash) in the others
CacheKey = BlockHash | tuple[int, BlockHash]


def cache_key(block_hash: BlockHash, group: int) -> CacheKey:
    """The key a block is cached under: its hash in group 0 (full attention, or the only group), (group, hash)
    in the others, so a hybrid model's groups never hit each other's blocks (one pool holds them all)."""
    return block_hash if not group else (group, block_hash)


class KVCacheBlock:
    """One block of `block_size` token slots. Doubly linked into the free queue while ref_cnt == 0."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks. Head = least recently freed = next evicted.

    O(1) popleft, append and remove (remove is what a prefix hit on a free cached block needs).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise AssertionError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every KV block. Block 0 is the null block: never handed out, never freed.

    Duplicate hashes are allowed (two requests may compute the same block before either is cached;
    block tables are append-only so neither swaps its block for the other's). `cached` maps a hash to its
    block, or to a dict of blocks only while duplicates exist: one dict per cached block would be the
    step loop's main source of long-lived garbage-collected objects.

    KV events (when enabled) describe the *set of hashes* a request can hit, not individual blocks:
    `BlockStored` when a hash enters `cached`, `BlockRemoved` when its last block is evicted,
    `AllBlocksCleared` on a reset. A duplicate block is silent both ways, so replaying the events into a
    set gives exactly `cached.keys()` (tests/unit/engine/test_kv_events.py).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self.cached: dict[BlockHash | tuple[int, BlockHash], KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._events: list[KVEvent] = []
        #: (block id, cache key) logs a KV connector reads (None = not recorded; see track_changes)
        self._newly_cached: list[tuple[int, BlockHash]] | None = None
        self._evicted: list[tuple[int, BlockHash]] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        total = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free_blocks / total

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """A block registered under `block_hash` in KV-cache group `group` (see `cache_key`)."""
        entry = self.cached.get(cache_key(block_hash, group))
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def cached_blocks(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        """Every block registered under `block_hash` (duplicates included)."""
        entry = self.cached.get(block_hash)
        if entry is None:
            return []
        return [entry] if type(entry) is KVCacheBlock else list(entry.values())

    # ------------------------------------------------------------------ mutation
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the LRU head, evicting their cached hashes; ref_cnt becomes 1."""
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        assert h is not None
        entry = self.cached.get(h)
        block.block_hash = None
        if entry is block:
            del self.cached[h]
            if self._evicted is not None:       # its KV is still intact until this step's forward pass
                self._evicted.append((block.block_id, h))
            if self.enable_kv_cache_events and type(h) is bytes:   # group 0's last block under `h` left
                self._events.append(BlockRemoved([h]))
        elif type(entry) is dict:
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                self.cached[h] = next(iter(entry.values()))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (pulling free ones out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free-queue tail in the given order."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          token_ids: Sequence[int], num_cached_blocks: int, num_full_blocks: int,
                          group: int = 0) -> None:
        """Register blocks [num_cached_blocks, num_full_blocks) of a request under their hashes, in KV-cache
        group `group` (null blocks, a sliding-window table's dropped entries, are skipped). Only group 0's
        hashes emit KV events; the connector logs get every group's, under their `cache_key`."""
        if num_cached_blocks >= num_full_blocks:
            return
        events = self.enable_kv_cache_events and not group
        newly_cached = self._newly_cached
        run_start: int | None = None          # first block of the current run of hashes new to the cache
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            is_new = False
            if block.is_null:
                if run_start is not None:     # a chain of stored hashes never spans a dropped block
                    self._emit_stored(block_hashes, token_ids, run_start, i)
                    run_start = None
                continue
            if block.block_hash is None:      # else a prefix hit: already registered
                h = cache_key(block_hashes[i], group)
                block.block_hash = h
                entry = self.cached.get(h)
                if entry is None:
                    self.cached[h] = block
                    is_new = True
                    if newly_cached is not None:
                        newly_cached.append((block.block_id, h))
                elif type(entry) is KVCacheBlock:
                    self.cached[h] = {entry.block_id: entry, block.block_id: block}
                else:
                    entry[block.block_id] = block
            if events and is_new and run_start is None:
                run_start = i
            elif events and not is_new and run_start is not None:
                self._emit_stored(block_hashes, token_ids, run_start, i)
                run_start = None
        if run_start is not None:
            self._emit_stored(block_hashes, token_ids, run_start, num_full_blocks)

    def _emit_stored(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                     end: int) -> None:
        """One BlockStored for blocks [start, end) of a request: a chain whose hashes are new to the cache."""
        bs = self.block_size
        self._events.append(BlockStored(
            block_hashes=list(block_hashes[start:end]),
            parent_block_hash=block_hashes[start - 1] if start else None,
            token_ids=list(token_ids[start * bs:end * bs]), block_size=bs))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False) while any block is held by a request."""
        if self.free_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ KV connector logs
    def track_changes(self, *, cached: bool, evicted: bool) -> None:
        """Record newly cached and/or evicted (block id, hash) pairs for `take_changes`."""
        self._newly_cached = [] if cached else None
        self._evicted = [] if evicted else None

    def has_changes(self) -> bool:
        return bool(self._newly_cached or self._evicted)

    def take_changes(self) -> tuple[list[tuple[int, BlockHash]], list[tuple[int, BlockHash]]]:
        """(newly cached, evicted) since the last call; both [] when not tracked."""
        cached, evicted = self._newly_cached or [], self._evicted or []
        if self._newly_cached:
            self._newly_cached = []
        if self._evicted:
            self._evicted = []
        return cached, evicted
