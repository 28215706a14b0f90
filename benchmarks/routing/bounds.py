"""Timing-free hit-rate bounds for a trace: one shared infinite cache, and separate per-replica LRU caches
with prefix groups pinned by a footprint-balanced partition (the bound issue 9's hit-rate targets use).

Both replay requests in arrival order and count a request's hit the way the engine does: the longest run
of its prompt's full blocks already present, never covering its last token. After a request, every full
block of its prompt and answer is present (what the engine caches once it ran).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from benchmarks.routing.workload import TraceRequest
from affinity_serve.engine.hashing import BlockHash


def group_key(r: TraceRequest) -> str:
    """The prefix group a request belongs to; a no-reuse request is a group of its own."""
    return r.group or r.req_id


def _hit_blocks(r: TraceRequest, hashes: Sequence[BlockHash], present, block_size: int) -> int:
    n = min((len(r.prompt_token_ids) - 1) // block_size, len(hashes))
    i = 0
    while i < n and hashes[i] in present:
        i += 1
    return i


def shared_cache_hit_rate(requests: Sequence[TraceRequest], full_hashes: Sequence[Sequence[BlockHash]],
                          block_size: int, measured: Sequence[bool]) -> float:
    """Token hit rate with one infinite cache shared by all replicas: an upper bound for every router.

    `full_hashes[i]` are the block hashes of request i's prompt + answer; `measured[i]` selects the
    requests counted (all requests warm the cache).
    """
    present: set[BlockHash] = set()
    hit = total = 0
    for r, hashes, m in zip(requests, full_hashes, measured):
        if m:
            hit += _hit_blocks(r, hashes, present, block_size) * block_size
            total += len(r.prompt_token_ids)
        present.update(hashes)
    return hit / total if total else 0.0


def footprint_partition(requests: Sequence[TraceRequest], full_hashes: Sequence[Sequence[BlockHash]],
                        num_replicas: int) -> dict[str, int]:
    """Prefix group -> replica: largest footprint (distinct blocks) first onto the lightest replica (LPT)."""
    blocks: dict[str, set[BlockHash]] = {}
    for r, hashes in zip(requests, full_hashes):
        blocks.setdefault(group_key(r), set()).update(hashes)
    heap = [(0, i) for i in range(num_replicas)]
    out: dict[str, int] = {}
    for g in sorted(blocks, key=lambda g: (-len(blocks[g]), g)):
        size, i = heapq.heappop(heap)
        out[g] = i
        heapq.heappush(heap, (size + len(blocks[g]), i))
    return out


def pinned_lru_hit_rate(requests: Sequence[TraceRequest], full_hashes: Sequence[Sequence[BlockHash]],
                        block_size: int, measured: Sequence[bool], assignment: dict[str, int],
                        blocks_per_replica: int) -> float:
    """Token hit rate with groups pinned by `assignment` and each replica an LRU cache of its KV blocks.

    Blocks are touched tail first, so a request's head is the most recently used (the engine frees a
    request's blocks tail first for the same reason).
    """
    caches: dict[int, OrderedDict[BlockHash, None]] = {}
    hit = total = 0
    for r, hashes, m in zip(requests, full_hashes, measured):
        lru = caches.setdefault(assignment[group_key(r)], OrderedDict())
        if m:
            hit += _hit_blocks(r, hashes, lru, block_size) * block_size
            total += len(r.prompt_token_ids)
        for h in reversed(hashes[:blocks_per_replica]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > blocks_per_replica:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def ttft_floor_s(requests: Sequence[TraceRequest], full_hashes: Sequence[Sequence[BlockHash]], block_size: int,
                 measured: Sequence[bool], step_base_s: float, prefill_per_token_s: float,
                 max_batched_tokens: int) -> list[float]:
    """Per measured request, the TTFT no router can beat (approximately): its prompt prefilled alone on an
    idle replica in chunks of `max_batched_tokens` (each step costs `step_base_s` plus `prefill_per_token_s`
    per token), with one shared infinite cache in which a block appears only once some earlier request
    could have computed it. A percentile of these is the floor of that percentile: a router whose TTFT p99
    is near it has nothing left to win there.

    Causal, not instantaneous: a sibling that arrives while the first request of its burst is still
    prefilling their shared prefix can hit it only by waiting for it (or compute it itself), so its floor
    is min over the cached run it uses of (wait for that run) + (prefill of the rest). Every request's
    blocks become available as it would compute them alone from its arrival: prompt blocks at the end of
    their chunk, answer blocks one decode step (`step_base_s`) per token after the prompt. A session turn
    counts from when its parent could have finished (alone) plus its think time, as the simulator releases
    it after the parent finished."""
    avail: dict[BlockHash, float] = {}
    done_at: dict[str, float] = {}
    out = []

    def prefill_s(tokens: int) -> float:
        return -(-tokens // max_batched_tokens) * step_base_s + tokens * prefill_per_token_s

    for r, hashes, m in zip(requests, full_hashes, measured):
        start = r.arrival_s
        if r.parent_id is not None and r.parent_id in done_at:
            start = max(start, done_at[r.parent_id] + r.think_s)
        prompt = len(r.prompt_token_ids)
        n = min((prompt - 1) // block_size, len(hashes))
        best, best_j, best_begin, ready = prefill_s(max(1, prompt)), 0, start, start
        for j in range(1, n + 1):
            t = avail.get(hashes[j - 1])
            if t is None:
                break
            ready = max(ready, t)
            ttft = ready - start + prefill_s(prompt - j * block_size)
            if ttft < best:
                best, best_j, best_begin = ttft, j, ready
        if m:
            out.append(best)
        # this request's own computation: prompt blocks after the run it used, then its answer's blocks
        t0 = best_begin
        num_prompt_blocks = prompt // block_size
        for i in range(best_j, min(num_prompt_blocks, len(hashes))):
            t = t0 + prefill_s((i + 1 - best_j) * block_size)
            if t < avail.get(hashes[i], float("inf")):
                avail[hashes[i]] = t
        first_token = start + best
        for i in range(num_prompt_blocks, len(hashes)):
            t = first_token + max(0, (i + 1) * block_size - prompt) * step_base_s
            if t < avail.get(hashes[i], float("inf")):
                avail[hashes[i]] = t
        done_at[r.req_id] = first_token + len(r.output_token_ids) * step_base_s
    return out
