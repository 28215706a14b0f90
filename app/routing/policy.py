"""AffinityPolicy: ranks candidates by predicted TTFT, with prefix affinity as a constraint a request releases.

The rule (README "Routing core API" writes it out with the defaults):
  1. Per candidate: cached = matched blocks x block size (at most the prompt's full blocks before its last
     token), where matched = the blocks in its paged pool plus the run after them it can load from a KV
     tier (its offload tier, its node's shared store); uncached = prompt - cached, TTFT =
     TTFTModel(queued + uncached, tier-loaded tokens, decode load, KV usage): a pool hit is free, a tier
     hit costs its load time.
  2. No candidate holds any block: SPILL (some non-candidate holds it, placed by TTFT) or NEW_GROUP: among
     the candidates whose TTFT is within tie_tolerance_s of the best, the one with the most cache room
     (occupancies within new_group_room_tolerance count as equal). Room only breaks load ties, so a burst of
     new groups cannot herd onto the emptiest replica: its own pending load soon takes it out of the tie.
  3. The prompt's prefix group (its first K block hashes) is hot, i.e. its demand over the window needs
     k > 1 replicas' capacity; a group with at least hot_share_min_requests x N requests in the window
     is also spread over at least ceil(its share of all grouped demand x N) replicas: while fewer than k candidates
     hold the group, the least loaded of all (TTFT
     as if each held what the best holder holds, so new holders join), else the best TTFT among the
     holders: HOT_REPLICA, released as in 4. A continuation (the best holder matches more blocks than the
     group's requests in the window all share) follows 4 instead: that reuse lives on one replica.
  4. Otherwise the affinity replica A (most predicted cached tokens, then most of them in its pool, then
     TTFT) is kept while
     TTFT(A) <= TTFT(best other) x (1 + release_slack) + release_slack_abs_s + the move's cost to the fleet
     (recompute time of the prefix it gives up x max(recompute weight x prefill saturation, cache weight x
     the other's cache fill)): AFFINITY; else RELEASED to the best TTFT.
  5. With evict_cost_weight > 0 the placements of 2 and 4 (and the hot holders' release) rank candidates by
     TTFT + evict_cost_weight x what the request's new blocks would later cost there (app/routing/eviction.py:
     the recompute beyond evict_tail_tokens of the least recently used prefixes they evict).
Scores within tie_tolerance_s of the best count as tied: a random one, the caller's node first.
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from affinity_serve.app.routing.api import BlockHash, CandidateScores, RankedIds, Reason, RouteRequest
from affinity_serve.app.routing.config import AffinityConfig
from affinity_serve.app.routing.load import ReplicaLoad, TTFTModel


@dataclass(slots=True)
class PolicyResult:
    ranked: Sequence[str]
    chosen_index: int
    reason: Reason
    scores: CandidateScores
    affinity_replica_id: str | None
    num_hot_replicas: int
    expected_output_tokens: int = 0      # what the request is expected to generate (HotGroups.expected_output)


class HotGroups:
    """Per prefix-group demand (prefill-token equivalents) over a sliding window; O(1) amortized.

    A request's decode part of the demand is its group's *observed* output length (an exponentially
    weighted mean of the group's finished requests, else of all groups', else `output_tokens_prior`), at
    most its declared max_tokens: a client that leaves max_tokens unset (the server then allows the whole
    context) must not make its group look hot.
    """

    OUTPUT_EWMA = 0.2

    def __init__(self, window_s: float, output_tokens_prior: float = 256.0) -> None:
        self.window_s = window_s
        self.output_tokens_prior = output_tokens_prior
        self._out: dict[BlockHash, float] = {}   # group -> observed output tokens (EWMA)
        self._out_all: float | None = None
        self._sums: dict[BlockHash, float] = {}
        self._total = 0.0                       # every group's demand in the window
        self._counts: dict[BlockHash, int] = {}  # requests per group in the window
        self._events: deque[tuple[float, BlockHash, float]] = deque()
        self._first_time: float | None = None
        # Per group: the first request's block hashes (at most MAX_SHARED_BLOCKS) and how many of them
        # every request of the group in the window has shared: the group's common prefix.
        self._shared: dict[BlockHash, tuple[tuple[BlockHash, ...], int]] = {}

    MAX_SHARED_BLOCKS = 256

    def expire(self, now: float) -> None:
        events, cutoff = self._events, now - self.window_s
        while events and events[0][0] <= cutoff:
            _, key, work = events.popleft()
            self._total = max(0.0, self._total - work)
            n = self._counts.get(key, 0) - 1
            if n > 0:
                self._counts[key] = n
            else:
                self._counts.pop(key, None)
            left = self._sums[key] - work
            if left <= 1e-9:
                del self._sums[key]
                self._shared.pop(key, None)
                self._out.pop(key, None)
            else:
                self._sums[key] = left

    def record(self, key: BlockHash, work_tokens: float, now: float,
               block_hashes: list[BlockHash] | None = None) -> None:
        if self._first_time is None:
            self._first_time = now
        if block_hashes is not None:
            self._note_prefix(key, block_hashes)
        self._sums[key] = self._sums.get(key, 0.0) + work_tokens
        self._total += work_tokens
        self._counts[key] = self._counts.get(key, 0) + 1
        self._events.append((now, key, work_tokens))

    def observe_output(self, key: BlockHash | None, num_output_tokens: int) -> None:
        """A finished request of the group produced this many tokens."""
        a = self.OUTPUT_EWMA
        self._out_all = (float(num_output_tokens) if self._out_all is None
                         else (1 - a) * self._out_all + a * num_output_tokens)
        if key is not None and key in self._sums:
            prev = self._out.get(key)
            self._out[key] = float(num_output_tokens) if prev is None else (1 - a) * prev + a * num_output_tokens

    def expected_output(self, key: BlockHash | None, max_tokens: int) -> float:
        """Output tokens to expect of a request of the group (observed), capped by its max_tokens if set."""
        est = self._out.get(key) if key is not None else None
        if est is None:
            est = self._out_all if self._out_all is not None else self.output_tokens_prior
        return min(est, max_tokens) if max_tokens > 0 else est

    def demand_tokens_per_s(self, key: BlockHash, now: float) -> float:
        """Window demand; while the router is younger than the window, over its age (at least 1 s)."""
        total = self._sums.get(key, 0.0)
        if not total or self._first_time is None:
            return 0.0
        return total / max(1.0, min(self.window_s, now - self._first_time))

    def num_requests(self, key: BlockHash) -> int:
        return self._counts.get(key, 0)

    def _note_prefix(self, key: BlockHash, hashes: list[BlockHash]) -> None:
        seen = self._shared.get(key)
        if seen is None:
            ref = tuple(hashes[:self.MAX_SHARED_BLOCKS])
            self._shared[key] = (ref, len(ref))
            return
        ref, depth = seen
        n, limit = 0, min(depth, len(hashes))
        while n < limit and hashes[n] == ref[n]:
            n += 1
        if n < depth:
            self._shared[key] = (ref, n)

    def shared_blocks(self, key: BlockHash) -> int | None:
        """Leading blocks every request of the group in the window shared (None: no request yet); a
        match deeper than this is a continuation (a session's next turn), not the group's prefix."""
        seen = self._shared.get(key)
        return None if seen is None else seen[1]

    def share(self, key: BlockHash) -> float:
        """The group's fraction of all grouped demand in the window (0-1)."""
        return self._sums.get(key, 0.0) / self._total if self._total > 0 else 0.0

    def __len__(self) -> int:
        return len(self._sums)


class AffinityPolicy:
    """Pure decision logic over CandidateStates (no index, no clocks of its own)."""

    def __init__(self, config: AffinityConfig, block_size: int, model: TTFTModel, rng: random.Random) -> None:
        self.config = config
        self.block_size = block_size
        self.model = model
        self.rng = rng
        self.groups = HotGroups(config.hot_window_s, config.output_tokens_prior)

    def group_key(self, request: RouteRequest) -> BlockHash | None:
        return self.group_key_of(request.block_hashes)

    def group_key_of(self, hashes: list[BlockHash]) -> BlockHash | None:
        return hashes[min(self.config.group_blocks, len(hashes)) - 1] if hashes else None

    def decide(self, request: RouteRequest, cands: list[ReplicaLoad], matched: dict[str, int],
               held_elsewhere: bool, occupancy: Callable[[ReplicaLoad], float], now: float,
               tier: dict[str, int] | None = None,
               evict_cost: Callable[[ReplicaLoad, int], float] | None = None) -> PolicyResult:
        """Choose among `cands` (non-empty). `matched`: leading blocks each holds in its pool (absent = 0);
        `tier`: blocks after those it can load from a KV tier (absent = 0); `held_elsewhere`: a
        non-candidate holds the first block; `occupancy(c)`: its cache fill (0-1); `evict_cost(c, blocks)`: the
        later recompute (s) that allocating `blocks` new blocks on c would cause (with evict_cost_weight > 0,
        new groups, spills and releases are ranked by TTFT plus that cost times the weight)."""
        cfg, bs, prompt = self.config, self.block_size, request.num_prompt_tokens
        max_blocks = max(0, prompt - 1) // bs
        pool = [matched.get(c.replica_id, 0) for c in cands] if matched else [0] * len(cands)
        pool_cached = [min(b, max_blocks) * bs for b in pool]
        if tier:
            blocks = [b + tier.get(c.replica_id, 0) for b, c in zip(pool, cands)]
            cached = [min(b, max_blocks) * bs for b in blocks]
            loaded = [k - p for k, p in zip(cached, pool_cached)]
        else:
            blocks, cached, loaded = pool, pool_cached, None
        key = self.group_key(request)
        out_tokens = int(self.groups.expected_output(key, request.max_tokens))
        own_blocks = [-(-(prompt - k + out_tokens) // bs) for k in cached]
        own = [prompt - k for k in cached]
        if cfg.kv_wait_weight > 0:     # KV pressure as a predicted wait for room, not the threshold penalty
            bare = self.model.predict_many(cands, own, loaded, own_blocks, kv_penalty=False)
            waits = self.model.kv_wait_many(cands, own_blocks, out_tokens, bs)
            ttft = [t + cfg.kv_wait_weight * w for t, w in zip(bare, waits)]
            if not all(c.stats.num_blocks for c in cands):     # no pool size reported: the penalty, as before
                pen = self.model.predict_many(cands, own, loaded, own_blocks)
                ttft = [t if c.stats.num_blocks else p for t, p, c in zip(ttft, pen, cands)]
        else:
            ttft = self.model.predict_many(cands, own, loaded, own_blocks)
        room: Callable[[int], bool] | None = None
        if cfg.measured_kv_wait_weight > 0:
            def room(i: int) -> bool:
                """Whether candidate i has KV room for the request now: no wait measured there, none
                predicted with it added (asked only of a release's target: O(1))."""
                c = cands[i]
                return c.stats.kv_wait_s <= 0 and self.model.kv_wait_many([c], [own_blocks[i]], out_tokens, bs)[0] <= 0
        if evict_cost is not None and cfg.evict_cost_weight > 0:
            w = cfg.evict_cost_weight
            place = [t + w * evict_cost(c, b) for t, c, b in zip(ttft, cands, own_blocks)]
        else:
            place = ttft
        everyone = range(len(cands))
        holders = [i for i in everyone if blocks[i] >= cfg.min_affinity_blocks]
        k = self._hot_k(key, len(cands), now)
        affinity: int | None = None
        group_len = min(cfg.group_blocks, len(request.block_hashes))
        shared = self.groups.shared_blocks(key) if key is not None else None
        if k > 1 and holders and shared is not None and max(blocks[i] for i in holders) > max(shared, group_len):
            # A continuation (a session's next turn) matches past the prefix the whole group shares: that
            # reuse lives on one replica, so it follows plain affinity. Spreading is for requests whose
            # only reuse is the group's common prefix (moving continuations cost an over-full 8-replica
            # fleet 0.02 of its token hit rate).
            k_for_request = 1
        else:
            k_for_request = k
        if not holders:
            if held_elsewhere:
                chosen, reason = self._pick(everyone, place, cands, request), Reason.SPILL
            else:
                chosen, reason = self._pick_room(place, cands, occupancy, request), Reason.NEW_GROUP
        elif k_for_request > 1:
            group = [i for i in holders if blocks[i] >= group_len]
            if len(group) < k:        # grow: place by load as if every candidate held what the best holds
                grow = self.model.predict_many(cands, [prompt - max(cached)] * len(cands))
                chosen, reason = self._pick(everyone, grow, cands, request), Reason.HOT_REPLICA
            else:
                chosen, reason = self._pick_released(group, place, cands, request, Reason.HOT_REPLICA, cached,
                                                 occupancy, room)
        else:
            most = max(cached[i] for i in holders)
            tops = [i for i in holders if cached[i] == most]
            most_pool = max(pool_cached[i] for i in tops)     # equal reuse: the pool's is free
            affinity = self._pick([i for i in tops if pool_cached[i] == most_pool], ttft, cands, request)
            chosen, reason = self._pick_released([affinity], place, cands, request, Reason.AFFINITY, cached,
                                                 occupancy, room)
        if key is not None:
            self.groups.record(key, prompt - cached[chosen] + cfg.decode_token_weight * out_tokens, now,
                               request.block_hashes)
        result = self._result(cands, cached, ttft, chosen, reason, affinity, k, loaded)
        result.expected_output_tokens = out_tokens
        return result

    def _hot_k(self, key: BlockHash | None, num_cands: int, now: float) -> int:
        if key is None:
            return 1
        capacity = self.model.prefill_tokens_per_s * self.config.hot_target_utilization
        k = math.ceil(self.groups.demand_tokens_per_s(key, now) / capacity)
        if k > 1 or self.groups.num_requests(key) >= self.config.hot_share_min_requests * num_cands:
            # A busy group also needs at least share x N replicas, or its holders carry more than the mean
            # load however fast their prefill is (a 90% prefix kept on 2 of 8 replicas put 4.5x the mean
            # load on each: TTFT barely notices decode load, end-to-end latency does).
            k = max(k, math.ceil(self.groups.share(key) * num_cands - 1e-9))
        return max(1, min(num_cands, k))

    def _pick_released(self, pool: list[int], ttft: list[float], cands: list[ReplicaLoad],
                       request: RouteRequest, reason: Reason, cached: list[int],
                       occupancy: Callable[[ReplicaLoad], float] | None = None,
                       room: Callable[[int], bool] | None = None) -> tuple[int, Reason]:
        """Best of `pool` unless a replica outside it beats it by more than the release slack plus what
        the move costs the fleet: the prefix it recomputes, weighted by how saturated the fleet's prefill
        is or how full the other replica's cache is, whichever weighs more.

        A release trades this request's wait for extra prefill work (the tokens cached at the holder but
        not at the other replica). While some replica is idle that work uses spare capacity; once every
        replica is queued it delays every request behind it, and at 1.5x load moving requests whose holder
        has most of the prompt onto replicas holding none of it only deepens the overload: the bound grows
        by `release_recompute_weight` x saturation x recompute time, saturation being the least queued
        replica's prefill backlog over `release_busy_horizon_s` (0: someone is idle, 1: everyone has that
        much queued). Spare prefill capacity does not make a move free when the other replica's pool is
        full: the copy evicts as many cached tokens of other prefixes there, which their next requests
        recompute, and the group's later requests split between two holders. So the bound also grows by
        `release_cache_weight` x that replica's cache fill (`occupancy`, 0-1) x recompute time. (Fleet
        traces at 1.5x load: an idle replica almost always existed, the first term was ~0, and releases to
        replicas with full pools cost 0.02-0.03 of the token hit rate.)"""
        cfg = self.config
        best_in = self._pick(pool, ttft, cands, request)
        inside = set(pool)
        outside = [i for i in range(len(cands)) if i not in inside]
        if not outside:
            return best_in, reason
        out = self._pick(outside, ttft, cands, request)
        bound = ttft[out] * (1.0 + cfg.release_slack) + cfg.release_slack_abs_s
        if ttft[best_in] <= bound:
            return best_in, reason
        w = cfg.measured_kv_wait_weight
        if w > 0 and room is not None and not room(out):
            # A holder's measured KV wait releases the request only to a replica with room for it: a move to a
            # pool short of blocks as well adds the prefix's blocks there, and under a fleet-wide KV overload
            # such moves scattered the prefixes (hit rate 0.85 of the separate-caches bound on one trace)
            ttft = [t - w * c.stats.kv_wait_s for t, c in zip(ttft, cands)]
            best_in = self._pick(pool, ttft, cands, request)
            out = self._pick(outside, ttft, cands, request)
            bound = ttft[out] * (1.0 + cfg.release_slack) + cfg.release_slack_abs_s
            if ttft[best_in] <= bound:
                return best_in, reason
        extra = cached[best_in] - cached[out]
        if extra > 0 and (cfg.release_recompute_weight > 0 or cfg.release_cache_weight > 0):
            rate = self.model.prefill_tokens_per_s
            backlog_s = min(c.queued_prefill_tokens for c in cands) / rate
            saturation = min(1.0, backlog_s / cfg.release_busy_horizon_s) if cfg.release_busy_horizon_s > 0 else 1.0
            fill = min(1.0, max(0.0, occupancy(cands[out]))) if occupancy is not None else 0.0
            weight = max(cfg.release_recompute_weight * saturation, cfg.release_cache_weight * fill)
            if ttft[best_in] <= bound + weight * extra / rate:
                return best_in, reason
        return out, Reason.RELEASED

    def _pick_room(self, ttft: list[float], cands: list[ReplicaLoad],
                   occupancy: Callable[[ReplicaLoad], float], request: RouteRequest) -> int:
        """Among the TTFT near-ties, the most cache room (a random one of equals, the caller's node first)."""
        best = min(ttft)
        near = [i for i in range(len(cands)) if ttft[i] <= best + self.config.tie_tolerance_s]
        occ = [occupancy(cands[i]) if i in near else 0.0 for i in range(len(cands))]
        least = min(occ[i] for i in near)
        roomy = [i for i in near if occ[i] <= least + self.config.new_group_room_tolerance]
        return self._pick(roomy, ttft, cands, request, tolerance=math.inf)

    def _pick(self, pool, score: list[float], cands: list[ReplicaLoad], request: RouteRequest,
              tolerance: float | None = None) -> int:
        """Lowest score in `pool`; near-ties to the caller's node, then at random."""
        best = min(score[i] for i in pool)
        tol = self.config.tie_tolerance_s if tolerance is None else tolerance
        tied = [i for i in pool if score[i] <= best + tol]
        if len(tied) > 1 and request.caller_node_id is not None:
            local = [i for i in tied if cands[i].node_id == request.caller_node_id]
            tied = local or tied
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def _result(self, cands: list[ReplicaLoad], cached: list[int], ttft: list[float], chosen: int,
                reason: Reason, affinity: int | None, k: int, loaded: list[int] | None = None) -> PolicyResult:
        order = sorted(range(len(cands)), key=ttft.__getitem__)
        scores = CandidateScores([c.replica_id for c in cands], cached, ttft,
                                 [c.queued_prefill_tokens for c in cands], [c.decode_load for c in cands],
                                 [c.kv_usage for c in cands], loaded if loaded is not None else [])
        ranked = RankedIds(scores.replica_ids, [chosen] + [i for i in order if i != chosen])
        return PolicyResult(ranked, chosen, reason, scores,
                            cands[affinity].replica_id if affinity is not None else None, k)
