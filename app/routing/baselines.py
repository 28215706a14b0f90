"""Load-only baseline policies behind the RouterCore shape: round_robin and power_of_two (no prefix index)."""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
import time
from collections import deque
from collections.abc import Callable

from app.routing.api import (CandidateScores, Decision, KVEventBatch, KVSnapshot, Reason, ReplicaInfo,
                             ReplicaLoadView, RouterCounters, RouteRequest)
from app.routing.config import AffinityConfig
from app.routing.load import LoadTracker


class _LoadOnlyCore(ABC):
    """Shared bookkeeping: stats and in-flight load (so power_of_two sees its own sends), decision records.
    KV events and snapshots are accepted and ignored."""

    def __init__(self, config: AffinityConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)
        self.loads = LoadTracker(config.max_in_flight_age_s)
        self._members: set[str] = set()
        self._decisions: deque[Decision] = deque(maxlen=config.recent_decisions)
        self._counters = RouterCounters()

    def set_replicas(self, replicas: list[ReplicaInfo]) -> None:
        new = {r.replica_id for r in replicas}
        for rid in self._members - new:
            self.loads.remove_replica(rid)
        for rid in new:
            self.loads.add_replica(rid)
        self._members = new

    def on_stats(self, replica_id: str, load: ReplicaLoadView) -> None:
        self.loads.set_stats(replica_id, load, self.clock())

    def on_kv_events(self, batch: KVEventBatch) -> bool:
        return True

    def replicas_needing_snapshot(self) -> list[str]:
        return []

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        """Load-only policies keep no KV index: snapshots (and events) are accepted and ignored."""

    def route(self, request: RouteRequest, candidate_ids: list[str]) -> Decision:
        start = time.perf_counter()
        if not candidate_ids:
            self._counters.num_errors += 1
            return Decision(request.request_id, [], "", Reason.FALLBACK, CandidateScores.empty(),
                            time.perf_counter() - start)
        now = self.clock()
        self.loads.expire(now)
        for rid in candidate_ids:
            if rid not in self._members:
                self._members.add(rid)
                self.loads.add_replica(rid)
        ranked = self._rank(list(candidate_ids))
        self.loads.add(request.request_id, ranked[0], uncached_tokens=request.num_prompt_tokens,
                       predicted_cached_tokens=0, num_prompt_tokens=request.num_prompt_tokens,
                       block_hashes=[], now=now)
        loads = [self.loads.get(rid) for rid in candidate_ids]
        scores = CandidateScores(list(candidate_ids), [0] * len(loads), [0.0] * len(loads),
                                 [c.queued_prefill_tokens for c in loads], [c.decode_load for c in loads],
                                 [c.kv_usage for c in loads])
        decision = Decision(request.request_id, ranked, ranked[0], Reason.LOAD, scores, time.perf_counter() - start)
        self._counters.num_decisions += 1
        self._counters.num_by_reason[decision.reason] = self._counters.num_by_reason.get(decision.reason, 0) + 1
        if self._decisions.maxlen:
            self._decisions.append(decision)
        return decision

    @abstractmethod
    def _rank(self, ids: list[str]) -> list[str]:
        """The candidates, best first (each baseline's whole policy)."""

    def _load_key(self, replica_id: str) -> tuple[int, int]:
        load = self.loads.get(replica_id)
        return load.queued_prefill_tokens, load.decode_load

    def on_routed(self, request_id: str, replica_id: str) -> None:
        f = self.loads.in_flight(request_id)
        if f is not None and f.replica_id != replica_id:
            self.loads.move(request_id, replica_id, uncached_tokens=f.num_prompt_tokens, predicted_cached_tokens=0,
                            now=self.clock())
            self._counters.num_rerouted += 1

    def on_first_token(self, request_id: str, num_cached_tokens: int | None = None) -> None:
        if num_cached_tokens is not None:
            self.on_actual_cached(request_id, num_cached_tokens)
        self.loads.start(request_id, self.clock())

    def on_actual_cached(self, request_id: str, num_cached_tokens: int) -> None:
        if self.loads.in_flight(request_id) is not None:
            self._counters.actual_cached_tokens += num_cached_tokens
            self._counters.num_accuracy_samples += 1

    def on_finished(self, request_id: str, num_output_tokens: int | None = None) -> None:
        self.loads.finish(request_id, self.clock())

    def recent_decisions(self, n: int) -> list[Decision]:
        return list(self._decisions)[-n:] if n > 0 else []

    def counters(self) -> RouterCounters:
        c = self._counters
        return RouterCounters(c.num_decisions, dict(c.num_by_reason), c.num_errors, c.num_rerouted, 0,
                              c.actual_cached_tokens, c.num_accuracy_samples)


class RoundRobinCore(_LoadOnlyCore):
    """Candidates in turn: the n-th decision starts at candidate n mod len (the rest follow in order)."""

    def __init__(self, config: AffinityConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        super().__init__(config, clock, rng)
        self._next = 0

    def _rank(self, ids: list[str]) -> list[str]:
        i = self._next % len(ids)
        self._next += 1
        return ids[i:] + ids[:i]


class PowerOfTwoCore(_LoadOnlyCore):
    """Two random candidates, the less loaded first (queued prefill tokens, then running); Serve's default
    shape with the router's own in-flight sends counted. The rest follow by load."""

    def _rank(self, ids: list[str]) -> list[str]:
        if len(ids) == 1:
            return ids
        pair = sorted(self.rng.sample(ids, 2), key=self._load_key)
        rest = sorted((r for r in ids if r not in pair), key=self._load_key)
        return pair + rest
