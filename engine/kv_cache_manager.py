"""KVCacheManager: per-request block tables over a BlockPool, prefix-hit lookup, allocation, freeing."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from affinity_serve.engine.block_pool import BlockPool, CacheKey, KVCacheBlock, cache_key
from affinity_serve.engine.kv_groups import KVCacheGroupSpec, blocks_needed, tokens_capacity, window_start_block
from affinity_serve.engine.request import Request
from affinity_serve.engine.types import KVEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (tokens looked up at admission, and tokens found)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class RecentPrefixCacheStats:
    """Prefix-cache queries and hits (tokens) over the last `max_requests` admissions.

    The lifetime ratio barely moves after a while and ignores a cache reset; operators and the
    router need the recent one (as vLLM's caching metrics keep it).
    """

    def __init__(self, max_requests: int):
        if max_requests < 1:
            raise ValueError(f"the recent prefix-cache window must hold >= 1 request, got {max_requests}")
        self._window: deque[tuple[int, int]] = deque(maxlen=max_requests)
        self.queries = 0
        self.hits = 0

    def record(self, queries: int, hits: int) -> None:
        w = self._window
        if len(w) == w.maxlen:
            old_queries, old_hits = w[0]      # about to fall out of the window
            self.queries -= old_queries
            self.hits -= old_hits
        w.append((queries, hits))
        self.queries += queries
        self.hits += hits

    def reset(self) -> None:
        self._window.clear()
        self.queries = self.hits = 0


class KVCacheManager:
    """Block tables for every live request.

    Deviation from vLLM v1: blocks are registered in the prefix cache by `cache_blocks()` once the
    runner has actually written their KV (the scheduler calls it from `update_from_output`), not at
    allocation time. A block is therefore never hit before its KV exists, even if its owner is
    preempted or aborted in the step that allocated it; the price is that two requests admitted in
    the same step cannot share a block computed in that step.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, *,
                 enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 recent_requests: int = 1000, groups: Sequence[KVCacheGroupSpec] | None = None,
                 max_chunk_tokens: int | None = None):
        """groups: the model's KV-cache groups (`kv_cache_groups`; None: one full-attention group). With a
        sliding-window group (`windowed`), each group has its own table, all of one length (`req_to_blocks`
        is group 0's); blocks a group's window has passed are dropped (null in the table) and freed as the
        request advances. max_chunk_tokens: the most tokens a request computes in one step (bounds what a
        sliding group holds, for `can_ever_fit`); None: a whole request."""
        self.groups = list(groups) if groups else [KVCacheGroupSpec((), None)]
        self.windowed = any(g.window is not None for g in self.groups)
        self.max_chunk_tokens = max_chunk_tokens
        #: per request, every group's table (windowed only; index 0 is req_to_blocks' list)
        self.req_to_group_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        #: per request and sliding group, how many leading entries are already dropped
        self._num_dropped: dict[str, list[int]] = {}
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_caching,
                              enable_kv_cache_events=enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        #: the same counts over the last `recent_requests` admissions; cleared by reset_prefix_cache
        self.recent = RecentPrefixCacheStats(recent_requests)
        #: bumps when the prefix cache is reset, so observers know their view is stale.
        self.cache_epoch = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, over every group."""
        if not self.windowed:
            return cdiv(num_tokens, self.block_size)
        return blocks_needed(self.groups, num_tokens, self.block_size, self.max_chunk_tokens)

    def max_tokens_capacity(self) -> int:
        if not self.windowed:
            return self.num_usable_blocks * self.block_size
        return tokens_capacity(self.groups, self.num_usable_blocks, self.block_size, self.max_chunk_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_usable_blocks

    # ------------------------------------------------------------------ lookup
    def reads_cache(self, request: Request) -> bool:
        """Whether `request` may take prefix hits now: not while it still owes prompt logprobs, which need
        every prompt position's logits (it still caches its own blocks for later requests)."""
        return self.enable_caching and (request.sampling_params.prompt_logprobs is None
                                        or request.num_output_tokens > 0)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request` as (blocks, num_tokens); never covers its last token.

        Pure: takes no references and records no stats (see `record_admission`). A request that still
        owes prompt logprobs gets no hit: they need every prompt position's logits (it still caches
        its own blocks for later requests).
        """
        if not self.reads_cache(request):
            return [], 0
        if self.windowed:
            return self._windowed_hits(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        pool = self.pool
        hits: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = pool.get_cached_block(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        self.recent.record(request.num_tokens, num_hit_tokens)

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *,
                       external: bool = False) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given hits).
        `external`: a KV connector fills them (whole blocks) instead of the model, so a sliding-window group
        gets blocks only from its window at their end (null entries before it: nothing reads them).

        Returns the newly allocated blocks (group 0's), or None, in which case nothing at all was changed.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        req_blocks = self.req_to_blocks.get(request.req_id)
        num_have = len(req_blocks) if req_blocks is not None else 0
        hits = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(min(num_computed + num_new_tokens, self.max_model_len), self.block_size)
        num_new_blocks = num_needed - num_have - len(hits)
        if self.windowed:
            first_read = num_computed + num_new_tokens if external else num_computed
            return self._allocate_windowed(request, num_computed, num_needed, hits, first_read)
        if num_new_blocks <= 0 and not hits:     # decode fast path: the last block has room
            return []
        # Free-but-cached hit blocks leave the free queue when touched, so they consume capacity too.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.req_id] = []
            self.num_cached_block[request.req_id] = 0
        if hits:
            self.pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_block[request.req_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now computed (in every group's table); then, with
        sliding windows, free the blocks no later query reads (each step, not only when a block is allocated)."""
        tables = self.req_to_group_blocks.get(request.req_id)
        self._cache_blocks(request, num_computed_tokens, tables)
        if tables is not None:
            self._drop_outside_windows(tables, self._num_dropped[request.req_id], num_computed_tokens)

    def _cache_blocks(self, request: Request, num_computed_tokens: int,
                      tables: list[list[KVCacheBlock]] | None) -> None:
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request.req_id)
        if num_cached is None or num_full <= num_cached:
            return
        for g, table in enumerate(tables or [self.req_to_blocks[request.req_id]]):
            self.pool.cache_full_blocks(table, request.block_hashes, request.all_token_ids, num_cached, num_full, g)
        self.num_cached_block[request.req_id] = num_full

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks out of its table without freeing them (a transfer still uses them);
        hand them to `free_blocks` later."""
        self.num_cached_block.pop(request.req_id, None)
        return self.req_to_blocks.pop(request.req_id, None) or []

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Free detached blocks, tail first (as `free`)."""
        self.pool.free_blocks(reversed(blocks))

    def block_keys(self, request: Request, start: int, end: int) -> list[tuple[int, CacheKey]]:
        """(block id, cache key) of every group's blocks [start, end) of `request` (null entries left out)."""
        tables = self.req_to_group_blocks.get(request.req_id) or [self.req_to_blocks.get(request.req_id, [])]
        hashes = request.block_hashes
        return [(t[i].block_id, cache_key(hashes[i], g)) for g, t in enumerate(tables)
                for i in range(start, min(end, len(t))) if not t[i].is_null]

    def computed_block_keys(self, request: Request) -> list[tuple[int, CacheKey]]:
        """`block_keys` of the request's computed, registered blocks (a sliding group's window of them)."""
        return self.block_keys(request, 0, self.num_cached_block.get(request.req_id, 0))

    def computed_block_ids(self, req_id: str) -> list[int]:
        """The request's blocks whose KV is computed and registered (block i holds block hash i)."""
        blocks = self.req_to_blocks.get(req_id, ())
        return [b.block_id for b in blocks[:self.num_cached_block.get(req_id, 0)]]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its shared head is evicted last."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_block.pop(request.req_id, None)
        tables = self.req_to_group_blocks.pop(request.req_id, None)
        self._num_dropped.pop(request.req_id, None)
        for table in tables or ([blocks] if blocks else ()):
            self.pool.free_blocks(reversed(table))

    # ------------------------------------------------------------------ misc
    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def group_block_ids(self, req_id: str) -> list[list[int]]:
        """Every group's whole table (dropped entries are the null block 0), group order."""
        return [[b.block_id for b in t] for t in self.req_to_group_blocks.get(req_id, ())]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds now, over every group (dropped entries not counted)."""
        tables = self.req_to_group_blocks.get(req_id) or [self.req_to_blocks.get(req_id, [])]
        return sum(1 for t in tables for b in t if not b.is_null)

    # ------------------------------------------------------------------ sliding windows
    def _window_start(self, group: KVCacheGroupSpec, first_position: int) -> int:
        return 0 if group.window is None else window_start_block(first_position, group.window, self.block_size)

    def _windowed_hits(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest hit every group can serve: full groups need every block before it, sliding groups only
        the blocks their window reads from its first uncached token (vLLM's hybrid rule). Group 0's view:
        dropped entries are the null block."""
        bs, pool = self.block_size, self.pool
        hashes = request.block_hashes
        n = min((request.num_tokens - 1) // bs, len(hashes))
        for g, spec in enumerate(self.groups):
            if spec.window is None:
                for i in range(n):
                    if pool.get_cached_block(hashes[i], g) is None:
                        n = i
                        break
        sliding = [g for g, spec in enumerate(self.groups) if spec.window is not None]
        while n > 0:                     # lower n to the last missing window block of any group, re-check
            missing = max((next((i for i in range(n - 1, self._window_start(self.groups[g], n * bs) - 1, -1)
                                 if pool.get_cached_block(hashes[i], g) is None), -1) for g in sliding),
                          default=-1)
            if missing < 0:
                break
            n = missing
        if n == 0:
            return [], 0
        start = self._window_start(self.groups[0], n * bs)
        return ([pool.null_block] * start + [pool.get_cached_block(hashes[i]) for i in range(start, n)],
                n * bs)

    def _drop_outside_windows(self, tables: list[list[KVCacheBlock]], dropped: list[int],
                              first_position: int) -> None:
        """Free each sliding group's blocks before its window at `first_position` (null in the table)."""
        null = self.pool.null_block
        for g, spec in enumerate(self.groups):
            if spec.window is None:
                continue
            table = tables[g]
            end = min(self._window_start(spec, first_position), len(table))
            if dropped[g] >= end:
                continue
            out = [b for b in table[dropped[g]:end] if not b.is_null]
            table[dropped[g]:end] = [null] * (end - dropped[g])
            dropped[g] = end
            self.pool.free_blocks(out)

    def _allocate_windowed(self, request: Request, num_computed: int, num_needed: int,
                           hits: list[KVCacheBlock], first_read: int) -> list[KVCacheBlock] | None:
        """allocate_slots for a model with sliding-window groups: drop what every window has passed, then
        give each group its blocks from its window's start at `first_read` (the first position a query
        will be computed at) to `num_needed`, null entries before that. Returns group 0's new blocks."""
        req_id, bs, pool = request.req_id, self.block_size, self.pool
        tables = self.req_to_group_blocks.get(req_id)
        if tables is not None:
            self._drop_outside_windows(tables, self._num_dropped[req_id], num_computed)
        num_have = len(tables[0]) if tables is not None else 0
        group_hits: list[list[KVCacheBlock]] = []
        if hits:                                     # admission: each group's own blocks for the same hashes
            n = len(hits)
            for g, spec in enumerate(self.groups):
                start = self._window_start(spec, n * bs)
                found = hits if g == 0 else [pool.null_block] * start + [
                    pool.get_cached_block(request.block_hashes[i], g) for i in range(start, n)]
                if any(b is None for b in found):
                    return None
                group_hits.append(found)
        num_new, num_null = [], []
        for spec in self.groups:
            first = max(num_have + len(hits), min(self._window_start(spec, first_read), num_needed))
            num_new.append(max(num_needed - first, 0))
            num_null.append(first - num_have - len(hits))
        evictable = sum(1 for found in group_hits for b in found if b.ref_cnt == 0 and not b.is_null)
        if sum(num_new) + evictable > pool.num_free_blocks:
            return None
        if tables is None:
            tables = self.req_to_group_blocks[req_id] = [[] for _ in self.groups]
            self.req_to_blocks[req_id] = tables[0]
            self.num_cached_block[req_id] = 0
            self._num_dropped[req_id] = [0] * len(self.groups)
        dropped = self._num_dropped[req_id]
        # every group's hits are taken before any new block is: a new block may evict a free cached one,
        # which must not be a later group's hit
        for g, found in enumerate(group_hits):
            pool.touch(b for b in found if not b.is_null)
            tables[g].extend(found)
            dropped[g] = self._window_start(self.groups[g], len(found) * bs)
        if group_hits:
            self.num_cached_block[req_id] = len(hits)
        new0: list[KVCacheBlock] = []
        for g, table in enumerate(tables):
            new = pool.get_new_blocks(num_new[g]) if num_new[g] > 0 else []
            table.extend([pool.null_block] * num_null[g])
            table.extend(new)
            if g == 0:
                new0 = new
        return new0

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.cache_epoch += 1
            self.recent.reset()
        return ok

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()
