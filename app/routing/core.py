"""PrefixAffinityRouterCore: the facade over PrefixIndex, LoadTracker and AffinityPolicy that a shell drives."""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable

from affinity_serve.app.routing.api import (BlockHash, CandidateScores, Decision, KVEventBatch, KVSnapshot, Reason,
                             ReplicaInfo, ReplicaLoadView, RouterCore, RouterCounters, RouteRequest)
from affinity_serve.app.routing.config import AffinityConfig, RoutingPolicyName
from affinity_serve.app.routing.eviction import EvictionShadow
from affinity_serve.app.routing.load import LoadTracker, ReplicaLoad, TTFTModel
from affinity_serve.app.routing.policy import AffinityPolicy
from affinity_serve.app.routing.prefix_index import PrefixIndex
from affinity_serve.app.routing.warmup import HotPrefixes

logger = logging.getLogger(__name__)

#: an admitted request's load is held on its best replica until a route matches it, at most this long
ADMISSION_HOLD_S = 10.0


class PrefixAffinityRouterCore:
    """The prefix-affinity policy (implements api.RouterCore; see its method contracts).

    `block_size` must be the engines' KV block size (RouteRequest carries one hash per full block of it).
    `clock` returns seconds (monotonic) and drives TTLs, windows and the TTFT calibration; `rng` breaks
    near-ties. Both injectable for simulators and tests. `decision_time_s` is always wall time
    (time.perf_counter), whatever the clock.
    """

    def __init__(self, config: AffinityConfig, block_size: int,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)
        self.index = PrefixIndex(config.max_index_entries, config.speculative_ttl_s, config.max_tier_index_entries)
        self.loads = LoadTracker(config.max_in_flight_age_s)
        self.model = TTFTModel(config)
        self.policy = AffinityPolicy(config, block_size, self.model, self.rng)
        self.hot = HotPrefixes(block_size, config.group_blocks, config.hot_window_s)
        #: the replicas' LRU order as this router's decisions imply it (only with evict_cost_weight > 0)
        self.shadow = (EvictionShadow(block_size, config.evict_key_blocks, config.evict_tail_tokens,
                                      default_capacity=config.index_blocks_per_unknown_replica)
                       if config.evict_cost_weight > 0 else None)
        self._nodes: dict[str, str | None] = {}
        self._decisions: deque[Decision] = deque(maxlen=config.recent_decisions)
        self._counters = RouterCounters()
        #: admission holds: (prompt tokens, first block hash) -> hold ids, oldest first; and by expiry
        self._last_wait: tuple | None = None
        self._holds: dict[tuple[int, BlockHash | None], deque[str]] = {}
        self._hold_expiry: deque[tuple[float, str, tuple[int, BlockHash | None]]] = deque()
        self._num_holds = 0
        #: admission predictions answered without the prefix match (predict_wait with a bound)
        self.num_admissions_unmatched = 0
        self._admission_rng = random.Random(1)     # its own: admission must not shift the routing's draws

    # ------------------------------------------------------------ membership, stats, events
    def set_replicas(self, replicas: list[ReplicaInfo]) -> None:
        new = {r.replica_id: r.node_id for r in replicas}
        for rid in [r for r in self._nodes if r not in new]:
            self.index.remove_replica(rid)
            self.loads.remove_replica(rid)
            if self.shadow is not None:
                self.shadow.remove_replica(rid)
        for rid, node_id in new.items():
            self.index.add_replica(rid, node_id)
            self.loads.add_replica(rid, node_id)
        self._nodes = new
        self._size_index()

    def on_stats(self, replica_id: str, load: ReplicaLoadView) -> None:
        before = self.loads.get(replica_id).stats.num_blocks
        self.loads.set_stats(replica_id, load, self.clock())
        if load.step_time_s is not None:
            self.model.observe_step_time(load.step_time_s)
        if load.num_blocks != before:
            self._size_index()
            if self.shadow is not None:
                self.shadow.set_capacity(replica_id, load.num_blocks)

    def _size_index(self) -> None:
        """The index holds what the fleet's pools hold: the sum of the replicas' reported pool sizes
        (`index_blocks_per_unknown_replica` for one that has not reported yet) times a margin, at most
        `max_index_entries`. O(replicas), on membership and pool-size changes only."""
        cfg = self.config
        total = sum(self.loads.get(rid).stats.num_blocks or cfg.index_blocks_per_unknown_replica
                    for rid in self._nodes)
        self.index.set_capacity(int(total * cfg.index_capacity_margin))

    def on_kv_events(self, batch: KVEventBatch) -> bool:
        self.hot.on_events(batch.events)
        return self.index.apply_events(batch)

    def replicas_needing_snapshot(self) -> list[str]:
        return self.index.replicas_needing_snapshot()

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        self.index.apply_snapshot(snapshot)

    def forget_kv_state(self) -> None:
        """The index and the hot prefixes (a paused router warms no joining replica with stale ones)."""
        self.index.forget_all()
        self.hot = HotPrefixes(self.block_size, self.config.group_blocks, self.config.hot_window_s)

    # ------------------------------------------------------------ routing
    def route(self, request: RouteRequest, candidate_ids: list[str]) -> Decision:
        start = time.perf_counter()
        try:
            decision = self._route(request, candidate_ids, start)
        except Exception:
            logger.exception("routing %s failed; falling back to load-only ranking", request.req_id)
            self._counters.num_errors += 1
            decision = self._fallback(request, candidate_ids, start)
        self._record(decision)
        return decision

    def _route(self, request: RouteRequest, candidate_ids: list[str], start: float) -> Decision:
        now = self.clock()
        self.index.expire(now)
        self._take_hold(request, now)
        self.loads.expire(now)
        self.policy.groups.expire(now)
        for rid in candidate_ids:
            if rid not in self._nodes:           # a replica Serve knows before set_replicas told us
                self._add_member(rid)
        matched = self.index.match(request.block_hashes, candidate_ids)
        tier = self.index.match_tiers(request.block_hashes, candidate_ids, matched)
        cands = [self.loads.get(rid) for rid in candidate_ids]
        held_elsewhere = (not matched and not tier and bool(request.block_hashes)
                          and self.index.holds_any(request.block_hashes[0]))
        result = self.policy.decide(request, cands, matched, held_elsewhere, self._occupancy, now, tier,
                                    self._evict_cost if self.shadow is not None else None)
        chosen = cands[result.chosen_index].replica_id
        cached = result.scores.predicted_cached_tokens[result.chosen_index]
        self.loads.add(request.req_id, chosen, uncached_tokens=request.num_prompt_tokens - cached,
                       predicted_cached_tokens=cached, num_prompt_tokens=request.num_prompt_tokens,
                       block_hashes=request.block_hashes, now=now,
                       tier_tokens=result.scores.tier_cached(result.chosen_index),
                       kv_blocks=-(-(request.num_prompt_tokens + result.expected_output_tokens) // self.block_size),
                       out_tokens=result.expected_output_tokens)
        self.index.insert_speculative(chosen, request.block_hashes, now, start=matched.get(chosen, 0))
        if self.shadow is not None:
            self.shadow.on_route(chosen, request.block_hashes,
                                 -(-(request.num_prompt_tokens + result.expected_output_tokens) // self.block_size),
                                 matched.get(chosen, 0), now)
        self.hot.on_route(request.block_hashes, request.num_prompt_tokens - cached, now)
        return Decision(request.req_id, result.ranked, chosen, result.reason, result.scores,
                        time.perf_counter() - start, result.affinity_replica_id, result.num_hot_replicas)

    def predict_wait(self, request: RouteRequest, candidate_ids: list[str],
                     bound: float | None = None) -> float | None:
        """The lowest TTFT the model predicts for `request` over the candidates, recording no load (the
        ingress's admission control: a request no replica can start within its bound is turned away before
        it queues; `hold_admitted` then counts one it lets in). None without candidates.

        With `bound` (admission's `serve.max_queue_wait_s`), first a look at two random candidates without
        the prefix match: if one would start the whole prompt uncached within the bound, that wait is returned
        (an upper bound of the lowest: admission only asks whether it is within the bound) and the hold counts
        the request there, uncached. O(1) instead of O(replicas) plus the match, which the routing does again;
        the full pass runs only near the bound, where the answer depends on what is cached and where.

        Beyond the routing TTFT (queued prefill, running load, KV pressure), each candidate's wait for KV
        room (TTFTModel.kv_wait_many): a backlog bound by the pool (long outputs: requests wait for running
        sequences to finish and free blocks) is a wait the prefill queue does not show; it stands in for the
        routing's bounded KV-pressure penalty on replicas that report their pool size. Routing does not use
        it: it is 0 wherever the demand fits the pool, and where it does not, the KV-pressure penalty already
        steers new work off a full pool; admission needs the size of the wait, routing an order."""
        ids = [rid for rid in candidate_ids if rid in self._nodes]
        if not ids:
            return None
        bs, prompt = self.block_size, request.num_prompt_tokens
        out_tokens = int(self.policy.groups.expected_output(self.policy.group_key(request), request.max_tokens))
        # uncached is the slowest start only where a tier loads faster than a prefill computes
        model = self.model
        if bound is not None and model.tier_load_tokens_per_s >= model.prefill_tokens_per_s:
            look = ids if len(ids) <= 2 else self._admission_rng.sample(ids, 2)
            waits = model.admission_waits([self.loads.get(rid) for rid in look], [0] * len(look), None, prompt,
                                          out_tokens, bs)
            i = min(range(len(waits)), key=waits.__getitem__)
            if waits[i] <= bound:
                self.num_admissions_unmatched += 1
                self._last_wait = (request, look[i], prompt, 0, 0, -(-(prompt + out_tokens) // bs), out_tokens)
                return waits[i]
        cands = [self.loads.get(rid) for rid in ids]
        matched = self.index.match(request.block_hashes, ids)
        tier = self.index.match_tiers(request.block_hashes, ids, matched)
        waits = self.model.admission_waits(cands, [matched.get(rid, 0) for rid in ids],
                                           [tier.get(rid, 0) for rid in ids] if tier else None,
                                           prompt, out_tokens, bs)
        i = min(range(len(waits)), key=waits.__getitem__)
        cap = max(0, prompt - 1) // bs
        pool = min(matched.get(ids[i], 0), cap) * bs
        cached = min(matched.get(ids[i], 0) + tier.get(ids[i], 0), cap) * bs
        self._last_wait = (request, ids[i], prompt - cached, cached, cached - pool,
                           -(-(prompt - cached + out_tokens) // bs), out_tokens)
        return waits[i]

    def _predict_wait_reference(self, request: RouteRequest, candidate_ids: list[str]) -> list[float]:
        """What `predict_wait` computes per candidate, in the routing's own terms (two predict_many passes
        and kv_wait_many): the reference `TTFTModel.admission_waits` is tested against."""
        ids = [rid for rid in candidate_ids if rid in self._nodes]
        matched = self.index.match(request.block_hashes, ids)
        tier = self.index.match_tiers(request.block_hashes, ids, matched)
        bs, prompt = self.block_size, request.num_prompt_tokens
        cap = max(0, prompt - 1) // bs
        cands = [self.loads.get(rid) for rid in ids]
        pool = [min(matched.get(rid, 0), cap) * bs for rid in ids]
        cached = [min(matched.get(rid, 0) + tier.get(rid, 0), cap) * bs for rid in ids]
        loaded = [c - p for c, p in zip(cached, pool)]
        out_tokens = int(self.policy.groups.expected_output(self.policy.group_key(request), request.max_tokens))
        own_blocks = [-(-(prompt - c + out_tokens) // bs) for c in cached]
        own = [prompt - c for c in cached]
        ttfts = self.model.predict_many(cands, own, loaded if tier else None, own_blocks)
        # Where a replica's pool size is known, its wait for KV room replaces the routing's bounded
        # KV-pressure penalty (both would count the same overage); elsewhere the penalty stays.
        bare = self.model.predict_many(cands, own, loaded if tier else None, own_blocks, kv_penalty=False)
        kv_waits = self.model.kv_wait_many(cands, own_blocks, out_tokens, bs)
        return [b + w if c.stats.num_blocks else t for c, t, b, w in zip(cands, ttfts, bare, kv_waits)]

    def hold_admitted(self, req_id: str) -> bool:
        """Count the request that `predict_wait` just judged (`req_id`) as load on its best replica until it
        is routed: a burst of requests admitted before any of them reaches the router must not each see the
        replicas as the first did. A later `route` of a request with the same prompt length and first block
        hash takes the hold's place (the router never sees the admission's ids); a hold nobody routes (the
        request failed before routing) lapses after ADMISSION_HOLD_S. False if `req_id` was not the last
        prediction."""
        memo, self._last_wait = self._last_wait, None
        if memo is None or memo[0].req_id != req_id:
            return False
        request, rid, uncached, cached, loaded, blocks, out_tokens = memo
        now = self.clock()
        self._expire_holds(now)
        self._num_holds += 1
        hold_id = f"admission-hold:{self._num_holds}"
        self.loads.add(hold_id, rid, uncached_tokens=uncached, predicted_cached_tokens=cached,
                       num_prompt_tokens=request.num_prompt_tokens, block_hashes=[], now=now, tier_tokens=loaded,
                       kv_blocks=blocks, out_tokens=out_tokens, held=True)
        key = _hold_key(request)
        self._holds.setdefault(key, deque()).append(hold_id)
        self._hold_expiry.append((now + ADMISSION_HOLD_S, hold_id, key))
        return True

    def _take_hold(self, request: RouteRequest, now: float) -> None:
        """The routed request replaces the oldest admission hold of its kind (its own load is added next)."""
        self._expire_holds(now)
        if self.loads.in_flight(request.req_id) is not None:
            return                               # routed before (Serve asks again): its hold is gone already
        key = _hold_key(request)
        held = self._holds.get(key)
        if held:
            self.loads.cancel(held.popleft())
            if not held:
                del self._holds[key]

    def _expire_holds(self, now: float) -> None:
        expiry = self._hold_expiry
        while expiry and expiry[0][0] <= now:
            _, hold_id, key = expiry.popleft()
            held = self._holds.get(key)
            if held and hold_id in held:
                held.remove(hold_id)
                self.loads.cancel(hold_id)
                if not held:
                    del self._holds[key]

    def _evict_cost(self, load: ReplicaLoad, new_blocks: int) -> float:
        return self.shadow.cost_s(load.replica_id, new_blocks, self.model.prefill_tokens_per_s)

    def _occupancy(self, load: ReplicaLoad) -> float:
        """Cache fill for new-group placement: the indexed share of the pool if its size is known."""
        num_blocks = load.stats.num_blocks
        if num_blocks:
            return min(1.0, self.index.num_held(load.replica_id) / num_blocks)
        return load.kv_usage

    def _fallback(self, request: RouteRequest, candidate_ids: list[str], start: float) -> Decision:
        """Load-only ranking that cannot fail on bad state: least queued prefill, random among equals."""
        ids = list(candidate_ids)
        self.rng.shuffle(ids)
        try:
            ids.sort(key=lambda rid: (self.loads.get(rid).queued_prefill_tokens, self.loads.get(rid).decode_load))
            if ids:
                self.loads.add(request.req_id, ids[0], uncached_tokens=request.num_prompt_tokens,
                               predicted_cached_tokens=0, num_prompt_tokens=request.num_prompt_tokens,
                               block_hashes=request.block_hashes, now=self.clock())
        except Exception:
            logger.exception("load-only fallback ranking failed too; candidates in random order")
        return Decision(request.req_id, ids, ids[0] if ids else "", Reason.FALLBACK, CandidateScores.empty(),
                        time.perf_counter() - start)

    def _record(self, decision: Decision) -> None:
        c = self._counters
        c.num_decisions += 1
        c.num_by_reason[decision.reason] = c.num_by_reason.get(decision.reason, 0) + 1
        if self._decisions.maxlen:
            self._decisions.append(decision)

    def _add_member(self, replica_id: str) -> None:
        self._nodes[replica_id] = None
        self.index.add_replica(replica_id)
        self.loads.add_replica(replica_id)
        self._size_index()

    # ------------------------------------------------------------ request lifecycle
    def on_routed(self, req_id: str, replica_id: str) -> None:
        f = self.loads.in_flight(req_id)
        if f is None or f.replica_id == replica_id:
            return
        if replica_id not in self._nodes:
            self._add_member(replica_id)
        now = self.clock()
        pool = self.index.match(f.block_hashes, [replica_id])
        matched = pool.get(replica_id, 0)
        loadable = self.index.match_tiers(f.block_hashes, [replica_id], pool).get(replica_id, 0)
        max_blocks = max(0, f.num_prompt_tokens - 1) // self.block_size
        pool_cached = min(matched, max_blocks) * self.block_size
        cached = min(matched + loadable, max_blocks) * self.block_size
        self.loads.move(req_id, replica_id, uncached_tokens=f.num_prompt_tokens - cached,
                        predicted_cached_tokens=cached, now=now, tier_tokens=cached - pool_cached)
        self.index.insert_speculative(replica_id, f.block_hashes, now, start=matched)
        self._counters.num_rerouted += 1

    def on_first_token(self, req_id: str, num_cached_tokens: int | None = None,
                       kv_wait_s: float | None = None) -> None:
        if num_cached_tokens is not None:
            self.on_actual_cached(req_id, num_cached_tokens)
        now = self.clock()
        f = self.loads.start(req_id, now)
        if f is None or f.remote:
            return
        ttft = now - f.routed_at
        if kv_wait_s is not None and kv_wait_s > 0 and self.config.kv_wait_calibration:
            ttft -= min(ttft, kv_wait_s)      # waiting for KV room is not prefill: the rates must not learn it
        if num_cached_tokens is None:
            uncached, loaded = f.uncached_tokens, f.tier_tokens
        else:
            # Cached beyond what the pool was predicted to hold came from the tier (at most as predicted).
            uncached = f.num_prompt_tokens - num_cached_tokens
            pool_predicted = f.predicted_cached_tokens - f.tier_tokens
            loaded = min(f.tier_tokens, max(0, num_cached_tokens - pool_predicted))
        self.model.observe(f.work_ahead_tokens + uncached, f.running_ahead, ttft, loaded)

    def on_actual_cached(self, req_id: str, num_cached_tokens: int) -> None:
        f = self.loads.in_flight(req_id)
        if f is None:
            return
        c = self._counters
        c.predicted_cached_tokens += f.predicted_cached_tokens
        c.actual_cached_tokens += num_cached_tokens
        c.num_accuracy_samples += 1

    def on_finished(self, req_id: str, num_output_tokens: int | None = None) -> None:
        now = self.clock()
        f = self.loads.finish(req_id, now)
        if f is not None and f.started:
            self.model.observe_lifetime(f.out_tokens, now - f.started_at)
        if f is not None and self.shadow is not None:
            self.shadow.on_finished(f.replica_id, f.block_hashes)
        if f is not None and num_output_tokens is not None:
            self.policy.groups.observe_output(self.policy.group_key_of(f.block_hashes), num_output_tokens)

    def hot_prefixes(self, n: int) -> list[list[int]]:
        """Token ids of the `n` hottest shared prefixes, to warm a joining replica (app/routing/warmup.py)."""
        return self.hot.hot_prefixes(n, self.clock())

    # ------------------------------------------------------------ inspection
    def recent_decisions(self, n: int) -> list[Decision]:
        return list(self._decisions)[-n:] if n > 0 else []

    def counters(self) -> RouterCounters:
        c = self._counters
        return RouterCounters(
            c.num_decisions, dict(c.num_by_reason), c.num_errors, c.num_rerouted, c.predicted_cached_tokens,
            c.actual_cached_tokens, c.num_accuracy_samples, self.index.num_resyncs, self.index.num_entries,
            self.index.num_evictions, self.model.prefill_tokens_per_s, self.model.decode_step_s,
            self.model.tier_load_tokens_per_s, self.index.num_tier_entries)


def _hold_key(request: RouteRequest) -> tuple[int, BlockHash | None]:
    return request.num_prompt_tokens, (request.block_hashes[0] if request.block_hashes else None)


def make_core(policy: RoutingPolicyName, config: AffinityConfig, block_size: int,
              clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> RouterCore:
    """The core for `routing.policy`: prefix_affinity | power_of_two | round_robin | llm_d_precise (a
    re-implementation of llm-d's precise scorer, for comparisons)."""
    from affinity_serve.app.routing.baselines import LlmdPreciseCore, PowerOfTwoCore, RoundRobinCore
    if policy == "prefix_affinity":
        return PrefixAffinityRouterCore(config, block_size, clock, rng)
    if policy == "llm_d_precise":
        return LlmdPreciseCore(config, block_size, clock, rng)
    if policy == "power_of_two":
        return PowerOfTwoCore(config, clock, rng)
    if policy == "round_robin":
        return RoundRobinCore(config, clock, rng)
    raise ValueError(f"unknown routing policy {policy!r}")
