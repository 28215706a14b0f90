"""Request and replica metrics (histograms, counters, gauges) recorded at the ingress."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from observability import names

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_DECISION_BUCKETS = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05]

# KV tier counters: (metric name, description, [(counter key in the replica's report, extra attributes)])
_KV_TIER_COUNTERS: list[tuple[str, str, list[tuple[str, dict[str, str]]]]] = [
    (names.M_KV_TIER_LOOKUPS, "KV tier lookups (admissions that asked the tier)", [("lookups", {})]),
    (names.M_KV_TIER_HIT_BLOCKS, "KV blocks the tier held at lookup", [("hit_blocks", {})]),
    (names.M_KV_TIER_HIT_TOKENS, "prompt tokens the tier held at lookup", [("hit_tokens", {})]),
    (names.M_KV_TIER_LOADS, "loads from the tier that completed", [("loads_ok", {})]),
    (names.M_KV_TIER_LOADED_BLOCKS, "KV blocks loaded from the tier", [("loaded_blocks", {})]),
    (names.M_KV_TIER_LOAD_FAILURES, "loads that failed (the request recomputed), by cause",
     [(f"load_failures_{c}", {"cause": c}) for c in ("missing", "damaged", "timed_out", "error")]),
    (names.M_KV_TIER_STORED_BLOCKS, "KV blocks written to the tier", [("stored_blocks", {})]),
    (names.M_KV_TIER_STORE_FAILURES, "KV blocks whose write to the tier failed", [("stores_failed", {})]),
    (names.M_KV_TIER_EVICTED_BLOCKS, "KV blocks the tier evicted", [("evicted_blocks", {})]),
    (names.M_KV_TIER_BYTES, "bytes moved between the pool and the tier, by direction",
     [("loaded_bytes", {"direction": "loaded"}), ("stored_bytes", {"direction": "stored"})]),
]


class ServingMetrics:
    def __init__(self, meter: metrics.Meter):
        self.ttft = meter.create_histogram(names.M_TTFT, unit="s", description="time to first token",
                                           explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.tpot = meter.create_histogram(names.M_TPOT, unit="s",
                                           description="time per output token, one sample per sequence",
                                           explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.e2e = meter.create_histogram(names.M_E2E, unit="s", description="end-to-end request latency",
                                          explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.prompt_tokens = meter.create_counter(names.M_PROMPT_TOKENS, description="prompt tokens")
        self.generation_tokens = meter.create_counter(names.M_GEN_TOKENS, description="generated tokens")
        self.cached_tokens = meter.create_counter(names.M_CACHED_TOKENS, description="prompt tokens from cache")
        self.http_requests = meter.create_counter(names.M_HTTP, description="HTTP responses by status")
        self.running = meter.create_gauge(names.M_RUNNING, description="running requests per replica")
        self.waiting = meter.create_gauge(names.M_WAITING, description="waiting requests per replica")
        self.kv_usage = meter.create_gauge(names.M_KV_USAGE, description="KV cache usage (0-1) per replica")
        self.prefix_hit_rate = meter.create_gauge(
            names.M_PREFIX_HIT, description="prefix-cache hit rate per replica since it started")
        self.recent_prefix_hit_rate = meter.create_gauge(
            names.M_PREFIX_HIT_RECENT, description="prefix-cache hit rate per replica over its recent requests")
        self.routing_decisions = meter.create_counter(
            names.M_ROUTING_DECISIONS, description="routing decisions by reason (affinity, released, ...)")
        self.routing_decision_time = meter.create_histogram(
            names.M_ROUTING_DECISION_TIME, unit="s", description="router decision time (wall)",
            explicit_bucket_boundaries_advisory=_DECISION_BUCKETS)
        self.routing_predicted_cached = meter.create_counter(
            names.M_ROUTING_PREDICTED_CACHED, description="cached prompt tokens the router predicted, on "
            "the replica the request ran on (decisions whose engine reported its cached tokens)")
        self.routing_actual_cached = meter.create_counter(
            names.M_ROUTING_ACTUAL_CACHED, description="cached prompt tokens the engine found, for the same "
            "decisions (index accuracy = actual / predicted)")
        #: (replica id, tier) -> that replica's cumulative KV connector counters, as last reported
        self._kv_tiers: dict[tuple[str, str], Mapping[str, int]] = {}
        for name, description, series in _KV_TIER_COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._kv_tier_callback(series)],
                                            description=description)

    def record_request(self, *, model: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                       ttft_s: float | None, e2e_s: float, tpot_s: Sequence[float] = ()) -> None:
        """`tpot_s`: one value per generated sequence, (last token time - first) / (its tokens - 1)."""
        attrs = {"model": model}
        self.prompt_tokens.add(prompt_tokens, attrs)
        self.generation_tokens.add(output_tokens, attrs)
        self.cached_tokens.add(cached_tokens, attrs)
        self.e2e.record(e2e_s, attrs)
        if ttft_s is not None:
            self.ttft.record(ttft_s, attrs)
        for t in tpot_s:
            self.tpot.record(t, attrs)

    def record_replica(self, replica_id: str, *, num_running: int, num_waiting: int, kv_cache_usage: float,
                       prefix_hit_rate: float, recent_prefix_hit_rate: float) -> None:
        attrs = {"replica": replica_id}
        self.running.set(num_running, attrs)
        self.waiting.set(num_waiting, attrs)
        self.kv_usage.set(kv_cache_usage, attrs)
        self.prefix_hit_rate.set(prefix_hit_rate, attrs)
        self.recent_prefix_hit_rate.set(recent_prefix_hit_rate, attrs)

    def record_routing(self, *, reason: str, decision_time_s: float, predicted_cached_tokens: int,
                       actual_cached_tokens: int | None) -> None:
        """One routing decision (at the ingress, when its request finishes)."""
        attrs = {"reason": reason}
        self.routing_decisions.add(1, attrs)
        self.routing_decision_time.record(decision_time_s, attrs)
        if actual_cached_tokens is not None:
            self.routing_predicted_cached.add(predicted_cached_tokens, attrs)
            self.routing_actual_cached.add(actual_cached_tokens, attrs)

    def record_kv_tier(self, replica_id: str, tier: str, counters: Mapping[str, int]) -> None:
        """A replica's KV connector counters (engine KVConnectorStats as a dict; cumulative since the
        replica started), exported as counters labelled by replica and tier ("offload", "shared")."""
        self._kv_tiers[(replica_id, tier)] = dict(counters)

    def _kv_tier_callback(self, series: list[tuple[str, dict[str, str]]]
                          ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for (replica_id, tier), counters in list(self._kv_tiers.items()):
                for key, extra in series:
                    if key in counters:
                        yield Observation(int(counters[key]), {"replica": replica_id, "tier": tier, **extra})
        return observe

    def record_http(self, route: str, status: int) -> None:
        self.http_requests.add(1, {"route": route, "status": str(status)})
