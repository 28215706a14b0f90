"""EvictionShadow: the router's estimate of each replica's LRU order, to price what new blocks would evict there.

An engine with a full prefix cache evicts one cached block for every block it allocates, the least recently
freed first (a chain's tail before its head). The KV events say *what* a pool holds, not in which order it
will go; this shadow keeps that order at the grain of prefix entries, from the router's own decisions:

- an entry is a replica's copy of one prefix, keyed by the prompt's block hash at depth
  min(prompt blocks, `key_depth`) (deep enough to separate sessions that share a short preamble, shallow
  enough that a tenant's questions on one system prompt fall into one entry);
- routing a request to a replica moves its entry to the recent end (its blocks are referenced, so not
  evictable, until the request finishes) and grows it by the blocks the replica did not hold; the finish
  moves it to the recent end again (freed blocks join the eviction queue there);
- past the replica's reported pool size the oldest entry loses blocks (its tail first) and then leaves the
  shadow, as the engine evicts them.

`cost_s(replica, new_blocks, rate)` walks the LRU end for the blocks that `new_blocks` would evict and
charges, per entry, the recompute time of the part of it lost beyond `tail_tokens` (a request that later
recomputes a few thousand tokens stays out of the TTFT tail; one that recomputes a 15k-token prefix sets
it), times the chance the entry is used again: 1 for an entry used twice or more (uses closer together than
REUSE_GAP_S count as one: a burst's siblings), else the measured share of single-use entries that got a
second use before they left the shadow. At most `max_walk` entries are walked per call, so a decision stays
O(candidates x max_walk). Tried on the fleet suite's loaded 8-replica cells, it did not lower the TTFT p99
beyond noise (docs/benchmarks/routing.md, "Placement against eviction"), so AffinityConfig leaves it off.
"""
from __future__ import annotations

from collections import OrderedDict

from affinity_serve.app.routing.api import BlockHash


class EvictionShadow:
    #: touches of an entry closer together than this count as one use (a burst's siblings arrive within
    #: milliseconds and share a prefix that may never come back; a reuse is a return after a while)
    REUSE_GAP_S = 1.0

    def __init__(self, block_size: int, key_depth: int = 64, tail_tokens: int = 4096, max_walk: int = 64,
                 default_capacity: int = 32_768) -> None:
        self.block_size = block_size
        self.key_depth = key_depth
        self.tail_tokens = tail_tokens
        self.max_walk = max_walk
        self.default_capacity = default_capacity
        #: replica -> entry key -> [blocks, uses, last use], least recently used first
        self._lru: dict[str, OrderedDict[BlockHash, list]] = {}
        self._total: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        # single-use entries: reused later vs left the shadow unused (a prior of one each)
        self.num_single_reused = 1
        self.num_single_died = 1

    def key_of(self, block_hashes: list[BlockHash]) -> BlockHash | None:
        return block_hashes[min(len(block_hashes), self.key_depth) - 1] if block_hashes else None

    def set_capacity(self, replica_id: str, num_blocks: int) -> None:
        if num_blocks > 0:
            self._capacity[replica_id] = num_blocks
            self._shrink(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        self._lru.pop(replica_id, None)
        self._total.pop(replica_id, None)
        self._capacity.pop(replica_id, None)

    def on_route(self, replica_id: str, block_hashes: list[BlockHash], total_blocks: int,
                 matched_blocks: int, now: float = 0.0) -> None:
        """A request whose prompt and output need `total_blocks` blocks went to the replica, which held its
        first `matched_blocks`, at `now` (s)."""
        key = self.key_of(block_hashes)
        if key is None:
            return
        lru = self._lru.setdefault(replica_id, OrderedDict())
        entry = lru.get(key)
        if entry is None:
            add = max(0, total_blocks - matched_blocks)
            lru[key] = [add, 1, now]
        else:
            add = max(0, total_blocks - entry[0])
            entry[0] += add
            if now - entry[2] >= self.REUSE_GAP_S:
                if entry[1] == 1:
                    self.num_single_reused += 1
                entry[1] += 1
            entry[2] = now
            lru.move_to_end(key)
        self._total[replica_id] = self._total.get(replica_id, 0) + add
        self._shrink(replica_id)

    def on_finished(self, replica_id: str, block_hashes: list[BlockHash]) -> None:
        lru = self._lru.get(replica_id)
        key = self.key_of(block_hashes)
        if lru is not None and key in lru:
            lru.move_to_end(key)

    def single_use_reuse_share(self) -> float:
        return self.num_single_reused / (self.num_single_reused + self.num_single_died)

    def cost_s(self, replica_id: str, new_blocks: int, prefill_tokens_per_s: float) -> float:
        """Predicted tail recompute (s) that allocating `new_blocks` on the replica causes later."""
        lru = self._lru.get(replica_id)
        if not lru:
            return 0.0
        capacity = self._capacity.get(replica_id, self.default_capacity)
        evict = new_blocks - max(0, capacity - self._total.get(replica_id, 0))
        if evict <= 0:
            return 0.0
        bs, tail, p1 = self.block_size, self.tail_tokens, self.single_use_reuse_share()
        lost_tokens = 0.0
        for walked, (blocks, uses, _) in enumerate(lru.values()):
            if walked >= self.max_walk or evict <= 0:
                break
            take = min(blocks, evict)
            evict -= take
            over = take * bs - tail
            if over > 0:
                lost_tokens += over * (1.0 if uses > 1 else p1)
        return lost_tokens / prefill_tokens_per_s

    def _shrink(self, replica_id: str) -> None:
        lru = self._lru.get(replica_id)
        if not lru:
            return
        capacity = self._capacity.get(replica_id, self.default_capacity)
        total = self._total.get(replica_id, 0)
        while total > capacity and lru:
            key, entry = next(iter(lru.items()))
            trim = min(entry[0], total - capacity)         # the engine evicts a chain's tail first
            entry[0] -= trim
            total -= trim
            if entry[0] <= 0:
                del lru[key]
                if entry[1] == 1:
                    self.num_single_died += 1
        self._total[replica_id] = total
