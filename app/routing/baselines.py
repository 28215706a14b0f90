"""Load-only baseline policies behind the RouterCore shape: round_robin and power_of_two (no prefix index)."""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
import time
from collections import deque
from collections.abc import Callable

from affinity_serve.app.routing.api import (CandidateScores, Decision, KVEventBatch, KVSnapshot, Reason, ReplicaInfo,
                             ReplicaLoadView, RouterCounters, RouteRequest)
from affinity_serve.app.routing.config import AffinityConfig
from affinity_serve.app.routing.load import LoadTracker


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

    def forget_kv_state(self) -> None:
        """No KV index to forget."""

    def route(self, request: RouteRequest, candidate_ids: list[str]) -> Decision:
        start = time.perf_counter()
        if not candidate_ids:
            self._counters.num_errors += 1
            return Decision(request.req_id, [], "", Reason.FALLBACK, CandidateScores.empty(),
                            time.perf_counter() - start)
        now = self.clock()
        self._expire(now)
        ids = list(candidate_ids)
        for rid in ids:
            if rid not in self._members:
                self._add_member(rid)
        decision = self._decide(request, ids, now, start)
        self._counters.num_decisions += 1
        self._counters.num_by_reason[decision.reason] = self._counters.num_by_reason.get(decision.reason, 0) + 1
        if self._decisions.maxlen:
            self._decisions.append(decision)
        return decision

    def _expire(self, now: float) -> None:
        self.loads.expire(now)

    def _add_member(self, replica_id: str) -> None:
        """A candidate Serve knows before set_replicas told this core."""
        self._members.add(replica_id)
        self.loads.add_replica(replica_id)

    @abstractmethod
    def _decide(self, request: RouteRequest, ids: list[str], now: float, start: float) -> Decision:
        """The policy's decision over `ids` (non-empty), its request recorded as in flight."""

    def on_routed(self, req_id: str, replica_id: str) -> None:
        f = self.loads.in_flight(req_id)
        if f is not None and f.replica_id != replica_id:
            self.loads.move(req_id, replica_id, uncached_tokens=f.num_prompt_tokens, predicted_cached_tokens=0,
                            now=self.clock())
            self._counters.num_rerouted += 1

    def on_first_token(self, req_id: str, num_cached_tokens: int | None = None,
                       kv_wait_s: float | None = None) -> None:
        if num_cached_tokens is not None:
            self.on_actual_cached(req_id, num_cached_tokens)
        self.loads.start(req_id, self.clock())

    def on_actual_cached(self, req_id: str, num_cached_tokens: int) -> None:
        f = self.loads.in_flight(req_id)
        if f is not None:
            self._counters.actual_cached_tokens += num_cached_tokens
            self._counters.predicted_cached_tokens += f.predicted_cached_tokens      # 0 unless it indexes
            self._counters.num_accuracy_samples += 1

    def on_finished(self, req_id: str, num_output_tokens: int | None = None) -> None:
        self.loads.finish(req_id, self.clock())

    def recent_decisions(self, n: int) -> list[Decision]:
        return list(self._decisions)[-n:] if n > 0 else []

    def counters(self) -> RouterCounters:
        c = self._counters
        index = getattr(self, "index", None)                     # llm_d_precise keeps a prefix index
        return RouterCounters(c.num_decisions, dict(c.num_by_reason), c.num_errors, c.num_rerouted,
                              c.predicted_cached_tokens, c.actual_cached_tokens, c.num_accuracy_samples,
                              index.num_resyncs if index is not None else 0,
                              index.num_entries if index is not None else 0,
                              index.num_evictions if index is not None else 0)


class _RankingCore(_LoadOnlyCore):
    """A policy that is a ranking of the candidates by load alone (no prefix index)."""

    def _decide(self, request: RouteRequest, ids: list[str], now: float, start: float) -> Decision:
        ranked = self._rank(ids)
        self.loads.add(request.req_id, ranked[0], uncached_tokens=request.num_prompt_tokens,
                       predicted_cached_tokens=0, num_prompt_tokens=request.num_prompt_tokens,
                       block_hashes=[], now=now)
        loads = [self.loads.get(rid) for rid in ids]
        scores = CandidateScores(ids, [0] * len(loads), [0.0] * len(loads),
                                 [c.queued_prefill_tokens for c in loads], [c.decode_load for c in loads],
                                 [c.kv_usage for c in loads])
        return Decision(request.req_id, ranked, ranked[0], Reason.LOAD, scores, time.perf_counter() - start)

    @abstractmethod
    def _rank(self, ids: list[str]) -> list[str]:
        """The candidates, best first (each baseline's whole policy)."""

    def _load_key(self, replica_id: str) -> tuple[int, int]:
        load = self.loads.get(replica_id)
        return load.queued_prefill_tokens, load.decode_load


class RoundRobinCore(_RankingCore):
    """Candidates in turn: the n-th decision starts at candidate n mod len (the rest follow in order)."""

    def __init__(self, config: AffinityConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        super().__init__(config, clock, rng)
        self._next = 0

    def _rank(self, ids: list[str]) -> list[str]:
        i = self._next % len(ids)
        self._next += 1
        return ids[i:] + ids[:i]


class PowerOfTwoCore(_RankingCore):
    """Two random candidates, the less loaded first (queued prefill tokens, then running); Serve's default
    shape with the router's own in-flight sends counted. The rest follow by load."""

    def _rank(self, ids: list[str]) -> list[str]:
        if len(ids) == 1:
            return ids
        pair = sorted(self.rng.sample(ids, 2), key=self._load_key)
        rest = sorted((r for r in ids if r not in pair), key=self._load_key)
        return pair + rest


class LlmdPreciseCore(_LoadOnlyCore):
    """llm-d's "precise prefix cache" scorer in its sticky-until-saturated shape, as a comparison policy
    (`routing.policy: llm_d_precise`), re-implemented from its public description:

    an index fed by the engines' KV events (the same feed and `PrefixIndex` as prefix_affinity) with
    speculative entries for `speculative_ttl_s` (llm-d: 2 s); the affinity filter keeps the candidates
    holding >= `affinity_threshold` of the prompt's blocks, unless the best of them has an estimated TTFT
    more than `max_ttft_penalty_s` above the best other (TTFT = this router's in-flight uncached tokens /
    the peak prefill rate, `AffinityConfig.prefill_tokens_per_s`); then the token-load scorer picks the
    lowest in-flight uncached tokens + this prompt's uncached part (ties at random)."""

    def __init__(self, config: AffinityConfig, block_size: int, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, *, affinity_threshold: float = 0.8,
                 max_ttft_penalty_s: float = 18.0, speculative_ttl_s: float = 2.0) -> None:
        super().__init__(config, clock, rng)
        from affinity_serve.app.routing.prefix_index import PrefixIndex
        self.block_size = block_size
        self.peak_tokens_per_s = config.prefill_tokens_per_s
        self.affinity_threshold = affinity_threshold
        self.max_ttft_penalty_s = max_ttft_penalty_s
        self.index = PrefixIndex(config.max_index_entries, speculative_ttl_s, config.max_tier_index_entries)
        self._tokens: dict[str, int] = {}                     # replica -> in-flight uncached tokens
        self._sent: dict[str, tuple[str, int]] = {}           # request -> (replica, uncached tokens)

    def set_replicas(self, replicas: list[ReplicaInfo]) -> None:
        new = {r.replica_id for r in replicas}
        for rid in self._members - new:
            self.index.remove_replica(rid)
            self._tokens.pop(rid, None)
        for r in replicas:
            self.index.add_replica(r.replica_id, r.node_id)
        super().set_replicas(replicas)

    def on_kv_events(self, batch: KVEventBatch) -> bool:
        return self.index.apply_events(batch)

    def replicas_needing_snapshot(self) -> list[str]:
        return self.index.replicas_needing_snapshot()

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        self.index.apply_snapshot(snapshot)

    def forget_kv_state(self) -> None:
        self.index.forget_all()

    def _expire(self, now: float) -> None:
        self.index.expire(now)
        self.loads.expire(now)

    def _add_member(self, replica_id: str) -> None:
        super()._add_member(replica_id)
        self.index.add_replica(replica_id)

    def _decide(self, request: RouteRequest, ids: list[str], now: float, start: float) -> Decision:
        hashes, prompt, bs = request.block_hashes, request.num_prompt_tokens, self.block_size
        matched = self.index.match(hashes, ids)
        cap = max(0, prompt - 1) // bs
        blocks = [min(matched.get(rid, 0), cap) for rid in ids]
        uncached = [prompt - b * bs for b in blocks]
        inflight = [self._tokens.get(rid, 0) for rid in ids]
        everyone = range(len(ids))
        pool, reason = list(everyone), Reason.LOAD
        if hashes:
            warm = [i for i in everyone if blocks[i] / len(hashes) >= self.affinity_threshold]
            cold = [i for i in everyone if blocks[i] / len(hashes) < self.affinity_threshold]
            if warm and (not cold or min(inflight[i] for i in warm) / self.peak_tokens_per_s
                         <= min(inflight[i] for i in cold) / self.peak_tokens_per_s + self.max_ttft_penalty_s):
                pool, reason = warm, Reason.AFFINITY
        score = [inflight[i] + uncached[i] for i in everyone]
        best = min(score[i] for i in pool)
        chosen = self.rng.choice([i for i in pool if score[i] == best])
        rid = ids[chosen]
        self._tokens[rid] = self._tokens.get(rid, 0) + uncached[chosen]
        self._sent[request.req_id] = (rid, uncached[chosen])
        self.index.insert_speculative(rid, hashes, now, start=blocks[chosen])
        self.loads.add(request.req_id, rid, uncached_tokens=uncached[chosen],
                       predicted_cached_tokens=prompt - uncached[chosen], num_prompt_tokens=prompt,
                       block_hashes=[], now=now)
        order = sorted(everyone, key=score.__getitem__)
        ranked = [rid] + [ids[i] for i in order if i != chosen]
        loads = [self.loads.get(r) for r in ids]
        scores = CandidateScores(ids, [p - u for p, u in zip([prompt] * len(ids), uncached)],
                                 [s / self.peak_tokens_per_s for s in score], inflight,
                                 [c.decode_load for c in loads], [c.kv_usage for c in loads])
        return Decision(request.req_id, ranked, rid, reason, scores, time.perf_counter() - start)

    def _retire(self, req_id: str) -> None:
        sent = self._sent.pop(req_id, None)
        if sent is not None:
            rid, tokens = sent
            if rid in self._tokens:
                self._tokens[rid] = max(0, self._tokens[rid] - tokens)

    def on_routed(self, req_id: str, replica_id: str) -> None:
        sent = self._sent.get(req_id)
        if sent is not None and sent[0] != replica_id:
            self._retire(req_id)
            self._tokens[replica_id] = self._tokens.get(replica_id, 0) + sent[1]
            self._sent[req_id] = (replica_id, sent[1])
        super().on_routed(req_id, replica_id)

    def on_first_token(self, req_id: str, num_cached_tokens: int | None = None,
                       kv_wait_s: float | None = None) -> None:
        self._retire(req_id)
        super().on_first_token(req_id, num_cached_tokens, kv_wait_s)

    def on_finished(self, req_id: str, num_output_tokens: int | None = None) -> None:
        self._retire(req_id)
        super().on_finished(req_id, num_output_tokens)
