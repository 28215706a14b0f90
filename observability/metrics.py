"""The metric instruments: `ServingMetrics` (recorded at the ingress, per request) and `ReplicaMetrics`
(exported by each model replica: its load read at every collection, so on the exporter's timer, and its
sequences' phase times). Names, units and descriptions come from observability/names.py."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from affinity_serve.observability import names
from affinity_serve.observability.names import METRICS, Kind

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
        for name, field in load_fields:
            spec = METRICS[name]
            make = meter.create_observable_gauge if spec.kind is Kind.GAUGE else meter.create_observable_counter
            make(name, callbacks=[self._load_callback(field)], description=spec.description)
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
