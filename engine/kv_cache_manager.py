"""KVCacheManager: per-request block tables over a BlockPool, prefix-hit lookup, allocation, freeing."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request
from engine.types import KVEvent


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
                 recent_requests: int = 1000):
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

    def max_tokens_capacity(self) -> int:
        return self.num_usable_blocks * self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks

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
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given hits).

        Returns the newly allocated blocks, or None, in which case nothing at all was changed.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        req_blocks = self.req_to_blocks.get(request.req_id)
        num_have = len(req_blocks) if req_blocks is not None else 0
        hits = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(min(num_computed + num_new_tokens, self.max_model_len), self.block_size)
        num_new_blocks = num_needed - num_have - len(hits)
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
        """Register the request's full blocks whose KV is now computed."""
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request.req_id)
        if num_cached is None or num_full <= num_cached:
            return
        self.pool.cache_full_blocks(self.req_to_blocks[request.req_id], request.block_hashes,
                                    request.all_token_ids, num_cached, num_full)
        self.num_cached_block[request.req_id] = num_full

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks out of its table without freeing them (a transfer still uses them);
        hand them to `free_blocks` later."""
        self.num_cached_block.pop(request.req_id, None)
        return self.req_to_blocks.pop(request.req_id, None) or []

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Free detached blocks, tail first (as `free`)."""
        self.pool.free_blocks(reversed(blocks))

    def computed_block_ids(self, req_id: str) -> list[int]:
        """The request's blocks whose KV is computed and registered (block i holds block hash i)."""
        blocks = self.req_to_blocks.get(req_id, ())
        return [b.block_id for b in blocks[:self.num_cached_block.get(req_id, 0)]]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its shared head is evicted last."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_block.pop(request.req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ misc
    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.cache_epoch += 1
            self.recent.reset()
        return ok

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()
