"""The metric instruments: `ServingMetrics` (recorded at the ingress, per request), `ReplicaMetrics`
(exported by each model replica: its load read at every collection, so on the exporter's timer, and its
sequences' phase times) and `RouterMetrics` (the routers of one process: their KV event feed and prefix
index, read at every collection). Names, units and descriptions come from observability/names.py."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from affinity_serve.observability import names
from affinity_serve.observability.names import METRICS, Kind

Labels = tuple[tuple[str, str], ...]      # sorted (name, value) pairs

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_DECISION_BUCKETS = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05]
_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]

# KV tier counters: (metric name, [(counter key in KVConnectorStats, extra attributes)])
_KV_TIER_COUNTERS: list[tuple[str, list[tuple[str, dict[str, str]]]]] = [
    (names.M_KV_TIER_LOOKUPS, [("lookups", {})]),
    (names.M_KV_TIER_HIT_BLOCKS, [("hit_blocks", {})]),
    (names.M_KV_TIER_HIT_TOKENS, [("hit_tokens", {})]),
    (names.M_KV_TIER_LOADS, [("loads_ok", {})]),
    (names.M_KV_TIER_LOADED_BLOCKS, [("loaded_blocks", {})]),
    (names.M_KV_TIER_LOAD_FAILURES,
     [(f"load_failures_{c}", {"cause": c}) for c in ("missing", "damaged", "timed_out", "error")]),
    (names.M_KV_TIER_STORED_BLOCKS, [("stored_blocks", {})]),
    (names.M_KV_TIER_STORE_FAILURES, [("stores_failed", {})]),
    (names.M_KV_TIER_EVICTED_BLOCKS, [("evicted_blocks", {})]),
    (names.M_KV_TIER_BYTES, [("loaded_bytes", {"direction": "loaded"}), ("stored_bytes", {"direction": "stored"})]),
]

#: the fallback causes of M_PD_FALLBACKS (a KV read's failure causes, then the prefill pool's call failing)
PD_FALLBACK_CAUSES = ("missing", "damaged", "timed_out", "error", "prefill_failed")

# P/D counters: (metric name, [(key in PDSample.counters, extra attributes)])
_PD_COUNTERS: list[tuple[str, list[tuple[str, dict[str, str]]]]] = [
    (names.M_PD_TRANSFERS, [("reads_ok", {"outcome": "read"}), ("reads_local", {"outcome": "local"}),
                            ("reads_failed", {"outcome": "failed"})]),
    (names.M_PD_TRANSFER_BLOCKS, [("read_blocks", {})]),
    (names.M_PD_TRANSFER_BYTES, [("read_bytes", {})]),
    (names.M_PD_FALLBACKS, [(f"fallback_{c}", {"cause": c}) for c in PD_FALLBACK_CAUSES]),
    (names.M_PD_HOLDS, [("holds_read", {"outcome": "read"}), ("holds_released", {"outcome": "released"}),
                        ("holds_expired", {"outcome": "expired"})]),
]


def _histogram(meter: metrics.Meter, name: str, buckets: list[float]):
    spec = METRICS[name]
    assert spec.kind is Kind.HISTOGRAM, name
    return meter.create_histogram(name, unit=spec.unit, description=spec.description,
                                  explicit_bucket_boundaries_advisory=buckets)


def _counter(meter: metrics.Meter, name: str):
    spec = METRICS[name]
    assert spec.kind is Kind.COUNTER, name
    return meter.create_counter(name, description=spec.description)


class ServingMetrics:
    """Recorded at the ingress: per-request latencies and tokens, HTTP statuses, routing decisions."""

    def __init__(self, meter: metrics.Meter):
        self.ttft = _histogram(meter, names.M_TTFT, _LATENCY_BUCKETS)
        self.tpot = _histogram(meter, names.M_TPOT, _LATENCY_BUCKETS)
        self.e2e = _histogram(meter, names.M_E2E, _LATENCY_BUCKETS)
        self.request_prompt_tokens = _histogram(meter, names.M_REQUEST_PROMPT_TOKENS, _TOKEN_BUCKETS)
        self.request_generation_tokens = _histogram(meter, names.M_REQUEST_GEN_TOKENS, _TOKEN_BUCKETS)
        self.prompt_tokens = _counter(meter, names.M_PROMPT_TOKENS)
        self.generation_tokens = _counter(meter, names.M_GEN_TOKENS)
        self.cached_tokens = _counter(meter, names.M_CACHED_TOKENS)
        self.http_requests = _counter(meter, names.M_HTTP)
        self.handle_requests = _counter(meter, names.M_HANDLE)
        self.routing_decisions = _counter(meter, names.M_ROUTING_DECISIONS)
        self.routing_decision_time = _histogram(meter, names.M_ROUTING_DECISION_TIME, _DECISION_BUCKETS)
        self.routing_predicted_cached = _counter(meter, names.M_ROUTING_PREDICTED_CACHED)
        self.routing_actual_cached = _counter(meter, names.M_ROUTING_ACTUAL_CACHED)

    def record_request(self, *, model: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                       ttft_s: float | None, e2e_s: float, tpot_s: Sequence[float] = ()) -> None:
        """`tpot_s`: one value per generated sequence, (last token time - first) / (its tokens - 1)."""
        attrs = {"model": model}
        self.prompt_tokens.add(prompt_tokens, attrs)
        self.generation_tokens.add(output_tokens, attrs)
        self.cached_tokens.add(cached_tokens, attrs)
        self.request_prompt_tokens.record(prompt_tokens, attrs)
        self.request_generation_tokens.record(output_tokens, attrs)
        self.e2e.record(e2e_s, attrs)
        if ttft_s is not None:
            self.ttft.record(ttft_s, attrs)
        for t in tpot_s:
            self.tpot.record(t, attrs)

    def record_routing(self, *, reason: str, decision_time_s: float, predicted_cached_tokens: int,
                       actual_cached_tokens: int | None) -> None:
        """One routing decision (at the ingress, when its request finishes)."""
        attrs = {"reason": reason}
        self.routing_decisions.add(1, attrs)
        self.routing_decision_time.record(decision_time_s, attrs)
        if actual_cached_tokens is not None:
            self.routing_predicted_cached.add(predicted_cached_tokens, attrs)
            self.routing_actual_cached.add(actual_cached_tokens, attrs)

    def record_http(self, route: str, status: int) -> None:
        self.http_requests.add(1, {"route": route, "status": str(status)})

    def record_handle(self, method: str, status: int) -> None:
        """One DeploymentHandle call of an inference method ended: 200, or its APIError's status. A stream
        counts when it ends (a failure after its first chunk counts as that failure)."""
        self.handle_requests.add(1, {"method": method, "status": str(status)})


@dataclass(frozen=True, slots=True)
class PDSample:
    """A P/D replica's transfer numbers at one read (plain values: the replica builds it from the engine's
    `take_pd_transfer_stats`): cumulative `counters` (the keys of _PD_COUNTERS), the blocks held now, and
    the read and hold times since its previous sample."""

    counters: Mapping[str, float]
    num_held_blocks: int
    read_times_s: Sequence[float] = ()
    hold_times_s: Sequence[tuple[float, str]] = ()     # (seconds, outcome)


@dataclass(frozen=True, slots=True)
class ReplicaLoadSample:
    """What a replica's gauges and load counters read at one collection (plain numbers: the replica builds
    it from the engine's load, so this module needs no engine import)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_hit_rate: float
    recent_prefix_hit_rate: float
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_preemptions_total: int


class ReplicaMetrics:
    """Exported by one model replica, every series labelled `replica`. The gauges and load counters call
    `read_load` whenever the meter is collected (the metrics pusher's timer, an OTLP export), so they are
    live while requests run; `read_kv_tier` (None without a connector) gives the KV connector's cumulative
    counters, exported labelled by tier."""

    def __init__(self, meter: metrics.Meter, replica_id: str, read_load: Callable[[], ReplicaLoadSample],
                 kv_tier: str = "none", read_kv_tier: Callable[[], Mapping[str, int] | None] | None = None):
        self.attrs = {"replica": replica_id}
        self._read_load = read_load
        self._kv_tier = kv_tier
        self._read_kv_tier = read_kv_tier
        self.queue_time = _histogram(meter, names.M_QUEUE_TIME, _LATENCY_BUCKETS)
        self.prefill_time = _histogram(meter, names.M_PREFILL_TIME, _LATENCY_BUCKETS)
        self.decode_time = _histogram(meter, names.M_DECODE_TIME, _LATENCY_BUCKETS)
        self.finished = _counter(meter, names.M_FINISHED)
        load_fields = [(names.M_RUNNING, "num_running"), (names.M_WAITING, "num_waiting"),
                       (names.M_KV_USAGE, "kv_cache_usage"), (names.M_PREFIX_HIT, "prefix_hit_rate"),
                       (names.M_PREFIX_HIT_RECENT, "recent_prefix_hit_rate"),
                       (names.M_PREFIX_QUERIES, "prefix_cache_queries_total"),
                       (names.M_PREFIX_HITS, "prefix_cache_hits_total"),
                       (names.M_PREEMPTIONS, "num_preemptions_total")]
        for name, load_field in load_fields:
            spec = METRICS[name]
            make = meter.create_observable_gauge if spec.kind is Kind.GAUGE else meter.create_observable_counter
            make(name, callbacks=[self._load_callback(load_field)], description=spec.description)
        for name, series in _KV_TIER_COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._kv_tier_callback(series)],
                                            description=METRICS[name].description)
        # P/D (a replica that never calls record_pd exports none of these series)
        self._pd: PDSample | None = None
        self.pd_transfer_time = _histogram(meter, names.M_PD_TRANSFER_TIME, _LATENCY_BUCKETS)
        self.pd_hold_time = _histogram(meter, names.M_PD_HOLD_TIME, _LATENCY_BUCKETS)
        for name, series in _PD_COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._pd_callback(series)],
                                            description=METRICS[name].description)
        meter.create_observable_gauge(names.M_PD_HELD_BLOCKS, callbacks=[self._pd_held_callback],
                                      description=METRICS[names.M_PD_HELD_BLOCKS].description)

    def record_pd(self, sample: PDSample) -> None:
        """A P/D replica's transfer numbers: the counters and gauge export its latest, the times are recorded."""
        self._pd = sample
        for secs in sample.read_times_s:
            self.pd_transfer_time.record(secs, self.attrs)
        for secs, outcome in sample.hold_times_s:
            self.pd_hold_time.record(secs, {**self.attrs, "outcome": outcome})

    def record_sequence(self, *, finish_reason: str, queue_s: float | None = None, prefill_s: float | None = None,
                        decode_s: float | None = None) -> None:
        """One sequence ended: its finish reason (stop, length, abort, error, ...) and, if it ran to the
        end, its phase times."""
        self.finished.add(1, {**self.attrs, "finish_reason": finish_reason})
        for hist, value in ((self.queue_time, queue_s), (self.prefill_time, prefill_s),
                            (self.decode_time, decode_s)):
            if value is not None:
                hist.record(value, self.attrs)

    def _load_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(getattr(self._read_load(), field), self.attrs)
        return observe

    def _pd_callback(self, series: list[tuple[str, dict[str, str]]]
                     ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            pd = self._pd
            if pd is None:
                return
            for key, extra in series:
                yield Observation(int(pd.counters.get(key, 0)), {**self.attrs, **extra})
        return observe

    def _pd_held_callback(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._pd is not None:
            yield Observation(self._pd.num_held_blocks, self.attrs)

    def _kv_tier_callback(self, series: list[tuple[str, dict[str, str]]]
                          ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            counters = self._read_kv_tier() if self._read_kv_tier is not None else None
            if not counters:
                return
            for key, extra in series:
                if key in counters:
                    yield Observation(int(counters[key]), {**self.attrs, "tier": self._kv_tier, **extra})
        return observe


@dataclass(frozen=True, slots=True)
class FeedReplicaSample:
    """The KV event feed's health for one replica, as one router saw it."""

    consecutive_timeouts: int
    lag_s: float            # since the replica last answered a pull (since the feed first asked, if never)


@dataclass(frozen=True, slots=True)
class IndexSample:
    """One prefix index of a router (pool or tier) at one read."""

    num_entries: int
    capacity: int
    num_evictions_total: int


@dataclass(frozen=True, slots=True)
class RouterSample:
    """One router's numbers at one read (plain values: the router builds it on its own loop,
    app/routing/serve_router.py). Counters are cumulative since the router was built. `index`: by index name
    (pool, tier), empty for a policy without one; `feed`: by replica id, empty without a KV event feed."""

    deployment: str
    num_pulls_ok: int = 0
    num_pulls_timed_out: int = 0
    num_pulls_error: int = 0
    num_events: int = 0
    num_snapshots: int = 0
    num_resyncs: int = 0
    num_core_errors: int = 0
    num_shell_errors: int = 0
    num_rerouted: int = 0
    index: Mapping[str, IndexSample] = field(default_factory=dict)
    feed: Mapping[str, FeedReplicaSample] = field(default_factory=dict)
    feed_paused: bool | None = None         # None: no KV event feed


# router counters: (metric name, [(RouterSample field, extra attributes)]), summed over a process's routers
_ROUTER_COUNTERS: list[tuple[str, list[tuple[str, dict[str, str]]]]] = [
    (names.M_ROUTING_FEED_PULLS, [("num_pulls_ok", {"outcome": "ok"}),
                                  ("num_pulls_timed_out", {"outcome": "timed_out"}),
                                  ("num_pulls_error", {"outcome": "error"})]),
    (names.M_ROUTING_FEED_EVENTS, [("num_events", {})]),
    (names.M_ROUTING_FEED_SNAPSHOTS, [("num_snapshots", {})]),
    (names.M_ROUTING_INDEX_RESYNCS, [("num_resyncs", {})]),
    (names.M_ROUTING_ERRORS, [("num_core_errors", {"where": "core"}), ("num_shell_errors", {"where": "shell"})]),
    (names.M_ROUTING_REROUTED, [("num_rerouted", {})]),
]


def _router_counts(s: RouterSample) -> Iterable[tuple[str, Labels, float]]:
    """A router sample's counters as (metric name, labels, value)."""
    for name, series in _ROUTER_COUNTERS:
        for key, extra in series:
            yield name, _labels({"deployment": s.deployment, **extra}), getattr(s, key)
    for index_name, ix in s.index.items():
        yield (names.M_ROUTING_INDEX_EVICTIONS, _labels({"deployment": s.deployment, "index": index_name}),
               ix.num_evictions_total)


def _labels(attrs: Mapping[str, str]) -> Labels:
    return tuple(sorted(attrs.items()))


class RouterMetrics:
    """The routers of one process, read whenever the meter is collected: `read()` gives (router label,
    RouterSample) for each live router; the label tells the app's routers apart (the Serve replica hosting it)
    and names one router for its life: the process never gives it to another router of the deployment.
    Counters are labelled by `deployment` only and summed over the process's routers of it (the app's hub then
    sums them over processes: a router's counts stay in the totals after its process is gone). A router that is
    read no more (collected: its handle dropped, its app redeployed) keeps its counts in the sums: its counts at
    its last read are folded into retired totals then, so a counter never goes back while the process lives.
    Gauges are each live router's own, labelled `router` and `deployment`, per `replica` for the feed."""

    def __init__(self, meter: metrics.Meter, read: Callable[[], Iterable[tuple[str, RouterSample]]]):
        self._read = read
        self._lock = threading.Lock()
        #: (deployment, router label) -> the router's sample at the last read
        self._last: dict[tuple[str, str], RouterSample] = {}
        #: metric name -> labels -> the counts of routers read no more
        self._retired: dict[str, dict[Labels, float]] = {}
        for name, _ in _ROUTER_COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._counter_callback(name)],
                                            description=METRICS[name].description)
        meter.create_observable_counter(names.M_ROUTING_INDEX_EVICTIONS,
                                        callbacks=[self._counter_callback(names.M_ROUTING_INDEX_EVICTIONS)],
                                        description=METRICS[names.M_ROUTING_INDEX_EVICTIONS].description)
        gauges = [(names.M_ROUTING_INDEX_ENTRIES, self._index_callback("num_entries")),
                  (names.M_ROUTING_INDEX_CAPACITY, self._index_callback("capacity")),
                  (names.M_ROUTING_FEED_TIMEOUT_STREAK, self._feed_callback("consecutive_timeouts")),
                  (names.M_ROUTING_FEED_LAG, self._feed_callback("lag_s")),
                  (names.M_ROUTING_FEED_PAUSED, self._paused_callback)]
        for name, callback in gauges:
            spec = METRICS[name]
            meter.create_observable_gauge(name, callbacks=[callback], unit=spec.unit, description=spec.description)

    def _samples(self) -> list[tuple[str, RouterSample]]:
        return self._read_and_retire()[0]

    def _read_and_retire(self) -> tuple[list[tuple[str, RouterSample]], dict[str, dict[Labels, float]]]:
        """The live routers' samples, and the retired totals with the routers gone since the last read folded
        in. One read at a time (collections may run on several threads): a router is folded once, and never
        counted both live and retired by one read."""
        with self._lock:
            live = list(self._read())
            now = {(s.deployment, label): s for label, s in live}
            for key, gone in self._last.items():
                if key not in now:
                    for name, labels, v in _router_counts(gone):
                        totals = self._retired.setdefault(name, {})
                        totals[labels] = totals.get(labels, 0) + v
            self._last = now
            return live, {name: dict(totals) for name, totals in self._retired.items()}

    def _counter_callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            live, retired = self._read_and_retire()
            totals = retired.get(name, {})
            for _, s in live:
                for n, labels, v in _router_counts(s):
                    if n == name:
                        totals[labels] = totals.get(labels, 0) + v
            return [Observation(v, dict(labels)) for labels, v in totals.items()]
        return observe

    def _index_callback(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for router, s in self._samples():
                for name, ix in s.index.items():
                    yield Observation(getattr(ix, field_name),
                                      {"router": router, "deployment": s.deployment, "index": name})
        return observe

    def _paused_callback(self, options: CallbackOptions) -> Iterable[Observation]:
        for router, s in self._samples():
            if s.feed_paused is not None:
                yield Observation(int(s.feed_paused), {"router": router, "deployment": s.deployment})

    def _feed_callback(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for router, s in self._samples():
                for replica, f in s.feed.items():
                    yield Observation(getattr(f, field_name),
                                      {"router": router, "deployment": s.deployment, "replica": replica})
        return observe


@dataclass(frozen=True, slots=True)
class AutoscaleSample:
    """One autoscaling decision for one deployment (plain values: autoscale/serve_policy.py builds it from a
    `ScalingDecision`, so this module needs no autoscale import)."""

    reason: str
    target_replicas: int
    current_replicas: int
    up_target: int
    down_target: int
    load_units: float
    prefill_units: float
    decode_units: float
    kv_units: float
    trend_units: float


_AUTOSCALER_GAUGES = [(names.M_AUTOSCALER_TARGET, "target_replicas"),
                      (names.M_AUTOSCALER_CURRENT, "current_replicas"),
                      (names.M_AUTOSCALER_UP_TARGET, "up_target"), (names.M_AUTOSCALER_DOWN_TARGET, "down_target"),
                      (names.M_AUTOSCALER_LOAD, "load_units"), (names.M_AUTOSCALER_PREFILL, "prefill_units"),
                      (names.M_AUTOSCALER_DECODE, "decode_units"), (names.M_AUTOSCALER_KV, "kv_units"),
                      (names.M_AUTOSCALER_TREND, "trend_units")]


class AutoscalerMetrics:
    """The autoscaling policy's decisions (it runs in Serve's controller), labelled `deployment`: the gauges
    read each deployment's latest decision when the meter is collected (the push timer, not the policy's
    tick); the counter counts every decision by `reason`. `record` is all the policy pays per tick."""

    def __init__(self, meter: metrics.Meter):
        self._latest: dict[str, AutoscaleSample] = {}
        self.decisions = _counter(meter, names.M_AUTOSCALER_DECISIONS)
        for name, sample_field in _AUTOSCALER_GAUGES:
            spec = METRICS[name]
            assert spec.kind is Kind.GAUGE, name
            meter.create_observable_gauge(name, callbacks=[self._gauge_callback(sample_field)],
                                          description=spec.description)

    def record(self, deployment: str, sample: AutoscaleSample) -> None:
        self._latest[deployment] = sample
        self.decisions.add(1, {"deployment": deployment, "reason": sample.reason})

    def _gauge_callback(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(getattr(s, field_name), {"deployment": d}) for d, s in list(self._latest.items())]
        return observe
