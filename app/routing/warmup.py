"""HotPrefixes: the prompt prefixes a router routes most, with their token ids, to warm a replica that joins.

A joining replica (scale-out, a replacement) has an empty cache. Prefilling the currently hottest prefixes
on it before affinity traffic finds it turns its first requests of those groups into cache hits. The
router knows which prefixes are hot (its requests' block hashes) but not their tokens; the engines' KV
events do carry them (BlockStored.token_ids). So:

  on each routed request  its prefix group's demand grows (decaying with `half_life_s`), and the group's
                          shared chain becomes the longest common prefix of its last two requests' first
                          `max_prefix_blocks` block hashes (the system prompt or document they share); those
                          hashes are marked wanted (LRU-bounded)
  on each BlockStored     the tokens of wanted block hashes, and of each chain's first blocks, are kept
                          (same bound; a hot prefix cached before this router saw it is stored only once)
  hot_prefixes(n)         the n hottest groups' shared chains as token ids, as far as their tokens are known

Bounded by `max_groups` groups and `max_blocks` wanted hashes / kept token blocks. A new group past the
bound evicts one: the coldest (decayed demand) of the EVICT_SAMPLE least recently routed, O(1) per request
(sorting all groups to drop the colder half cost a 128-replica decision 2-3 ms every few hundred new
groups, in the slowest 1% of decisions). Salted prompts are
skipped: their hashes depend on a salt the events do not carry, so a replay without it would not hit.
Pure and not thread-safe, like the rest of the core.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from affinity_serve.app.routing.api import BlockHash
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.types import BlockStored, KVEvent


@dataclass(slots=True)
class _Group:
    score: float = 0.0
    updated: float = 0.0
    num_requests: int = 0
    last_chain: list[BlockHash] = field(default_factory=list)
    shared: list[BlockHash] = field(default_factory=list)


class HotPrefixes:
    def __init__(self, block_size: int, group_blocks: int, half_life_s: float = 10.0,
                 max_prefix_blocks: int = 32, max_groups: int = 1024, max_blocks: int = 8192) -> None:
        self.block_size = block_size
        self.group_blocks = group_blocks
        self.decay_per_s = math.log(2) / half_life_s
        self.max_prefix_blocks = max_prefix_blocks
        self.max_groups = max_groups
        self.max_blocks = max_blocks
        self._groups: dict[BlockHash, _Group] = {}
        self._wanted: dict[BlockHash, None] = {}         # LRU order: oldest first
        self._tokens: dict[BlockHash, list[int]] = {}    # LRU order: oldest first

    def on_route(self, block_hashes: list[BlockHash], work_tokens: float, now: float) -> None:
        """A request with these block hashes was routed; `work_tokens` weighs its demand."""
        if not block_hashes:
            return
        key = block_hashes[min(self.group_blocks, len(block_hashes)) - 1]
        groups = self._groups
        g = groups.pop(key, None)                   # re-inserted below: the dict is in routing order
        if g is None:
            if len(groups) >= self.max_groups:
                self._evict_one(now)
            g = _Group(updated=now)
        groups[key] = g
        g.score = self._decayed(g, now) + max(1.0, work_tokens)
        g.updated = now
        g.num_requests += 1
        chain = block_hashes[:self.max_prefix_blocks]
        g.shared = chain if g.num_requests == 1 else _common_prefix(g.last_chain, chain)
        g.last_chain = chain
        wanted = self._wanted
        for h in chain:
            wanted.pop(h, None)
            wanted[h] = None
        _trim(wanted, self.max_blocks)

    def on_events(self, events: list[KVEvent]) -> None:
        """Keep the token ids of stored blocks some group wants, and of every chain's first
        `max_prefix_blocks` blocks (a prefix cached before this router routed it is stored only once)."""
        wanted, tokens, bs, head_blocks = self._wanted, self._tokens, self.block_size, self.max_prefix_blocks
        for event in events:
            if not isinstance(event, BlockStored) or event.block_size != bs:
                continue
            head = event.parent_block_hash is None
            for i, h in enumerate(event.block_hashes):
                if (head and i < head_blocks) or h in wanted:
                    tokens.pop(h, None)
                    tokens[h] = event.token_ids[i * bs:(i + 1) * bs]
        _trim(tokens, self.max_blocks)

    def hot_prefixes(self, n: int, now: float) -> list[list[int]]:
        """Token ids of the `n` hottest groups (seen at least twice) whose shared chain's tokens are known
        from its first block on; each at least one block, hottest first."""
        ranked = sorted((g for g in self._groups.values() if g.num_requests >= 2),
                        key=lambda g: self._decayed(g, now), reverse=True)
        out: list[list[int]] = []
        for g in ranked:
            if len(out) >= n:
                break
            ids = self._tokens_of(g.shared)
            if ids:
                out.append(ids)
        return out

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_token_blocks(self) -> int:
        return len(self._tokens)

    def _tokens_of(self, chain: list[BlockHash]) -> list[int]:
        ids: list[int] = []
        num_blocks = 0
        for h in chain:
            block = self._tokens.get(h)
            if block is None:
                break
            ids += block
            num_blocks += 1
        if not num_blocks or hash_block_chain(ids, self.block_size)[-1] != chain[num_blocks - 1]:
            return []            # nothing known, or a salted prompt (its replay would not hit)
        return ids

    def _decayed(self, g: _Group, now: float) -> float:
        return g.score * math.exp(-self.decay_per_s * max(0.0, now - g.updated))

    def _evict_one(self, now: float) -> None:
        """Drop the coldest of the EVICT_SAMPLE least recently routed groups (O(1))."""
        oldest = [kv for kv, _ in zip(self._groups.items(), range(EVICT_SAMPLE))]
        key, _ = min(oldest, key=lambda kv: self._decayed(kv[1], now))
        del self._groups[key]


#: groups a new one past the bound compares to evict the coldest of (the least recently routed ones)
EVICT_SAMPLE = 8


def _common_prefix(a: list[BlockHash], b: list[BlockHash]) -> list[BlockHash]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return b[:n]


def _trim(lru: dict, bound: int) -> None:
    if len(lru) > bound:
        for h in [h for h, _ in zip(lru, range(len(lru) - bound))]:
            del lru[h]
