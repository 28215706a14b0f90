"""Metric and span names in one place: every metric's spec (kind, unit, description, vLLM alias), from which
the instruments are made (observability/metrics.py), the Prometheus text is written
(observability/aggregate.py), and the Grafana dashboard's queries are checked (tests)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

SPAN_REQUEST = "llm.request"
SPAN_ROUTING = "llm.routing"
SPAN_QUEUE = "llm.queue"
SPAN_PREFILL = "llm.prefill"
SPAN_DECODE = "llm.decode"
SPAN_ENGINE = "llm.engine"

# ------------------------------------------------------------------ recorded at the ingress (per request)
M_TTFT = "affinity_time_to_first_token"
M_TPOT = "affinity_time_per_output_token"
M_E2E = "affinity_e2e_request_latency"
M_PROMPT_TOKENS = "affinity_prompt_tokens"
M_GEN_TOKENS = "affinity_generation_tokens"
M_CACHED_TOKENS = "affinity_cached_prompt_tokens"
M_REQUEST_PROMPT_TOKENS = "affinity_request_prompt_tokens"
M_REQUEST_GEN_TOKENS = "affinity_request_generation_tokens"
M_HTTP = "affinity_http_requests"
M_HANDLE = "affinity_handle_requests"
M_ROUTING_DECISIONS = "affinity_routing_decisions"
M_ROUTING_DECISION_TIME = "affinity_routing_decision_time"
M_ROUTING_PREDICTED_CACHED = "affinity_routing_predicted_cached_tokens"
M_ROUTING_ACTUAL_CACHED = "affinity_routing_actual_cached_tokens"

# ------------------------------------------------------------------ kept by each router (app/routing), read on the
# push timer: one router per (process, routed deployment). Counters are summed over the app's routers (label
# `deployment`); gauges are each router's own (label `router`: the Serve replica hosting it), per model
# replica (`replica`) for the KV event feed's health.
M_ROUTING_FEED_PULLS = "affinity_routing_kv_feed_pulls"
M_ROUTING_FEED_EVENTS = "affinity_routing_kv_feed_events"
M_ROUTING_FEED_SNAPSHOTS = "affinity_routing_kv_feed_snapshots"
M_ROUTING_FEED_TIMEOUT_STREAK = "affinity_routing_kv_feed_consecutive_timeouts"
M_ROUTING_FEED_LAG = "affinity_routing_kv_feed_lag"
M_ROUTING_FEED_PAUSED = "affinity_routing_kv_feed_paused"
M_ROUTING_INDEX_ENTRIES = "affinity_routing_index_entries"
M_ROUTING_INDEX_CAPACITY = "affinity_routing_index_capacity"
M_ROUTING_INDEX_EVICTIONS = "affinity_routing_index_evictions"
M_ROUTING_INDEX_RESYNCS = "affinity_routing_index_resyncs"
M_ROUTING_ERRORS = "affinity_routing_errors"
M_ROUTING_REROUTED = "affinity_routing_rerouted"

# ------------------------------------------------------------------ exported by each model replica (on a timer)
M_RUNNING = "affinity_replica_running_requests"
M_WAITING = "affinity_replica_waiting_requests"
M_KV_USAGE = "affinity_replica_kv_cache_usage"
M_PREFIX_HIT = "affinity_replica_prefix_cache_hit_rate"
M_PREFIX_HIT_RECENT = "affinity_replica_recent_prefix_cache_hit_rate"
M_PREFIX_QUERIES = "affinity_replica_prefix_cache_queries"
M_PREFIX_HITS = "affinity_replica_prefix_cache_hits"
M_PREEMPTIONS = "affinity_replica_preemptions"
M_QUEUE_TIME = "affinity_request_queue_time"
M_PREFILL_TIME = "affinity_request_prefill_time"
M_DECODE_TIME = "affinity_request_decode_time"
M_FINISHED = "affinity_requests_finished"

# KV tiers below the paged pool (engine/kv_connector: the offload tier, the node-shared store), per replica
# and tier
M_KV_TIER_LOOKUPS = "affinity_kv_tier_lookups"
M_KV_TIER_HIT_BLOCKS = "affinity_kv_tier_hit_blocks"
M_KV_TIER_HIT_TOKENS = "affinity_kv_tier_hit_tokens"
M_KV_TIER_LOADS = "affinity_kv_tier_loads"
M_KV_TIER_LOADED_BLOCKS = "affinity_kv_tier_loaded_blocks"
M_KV_TIER_LOAD_FAILURES = "affinity_kv_tier_load_failures"
M_KV_TIER_STORED_BLOCKS = "affinity_kv_tier_stored_blocks"
M_KV_TIER_STORE_FAILURES = "affinity_kv_tier_store_failures"
M_KV_TIER_EVICTED_BLOCKS = "affinity_kv_tier_evicted_blocks"
M_KV_TIER_BYTES = "affinity_kv_tier_bytes"

# P/D disaggregation (engine/kv_connector/pd.py, app/disagg.py), per replica: the decode side's KV reads and
# fallbacks, the prefill side's holds
M_PD_TRANSFERS = "affinity_pd_transfers"
M_PD_TRANSFER_BLOCKS = "affinity_pd_transfer_blocks"
M_PD_TRANSFER_BYTES = "affinity_pd_transfer_bytes"
M_PD_TRANSFER_TIME = "affinity_pd_transfer_time"
M_PD_FALLBACKS = "affinity_pd_fallbacks"
M_PD_HOLDS = "affinity_pd_holds"
M_PD_HOLD_TIME = "affinity_pd_hold_time"
M_PD_HELD_BLOCKS = "affinity_pd_held_blocks"

# ------------------------------------------------------------------ kept by the autoscaling policy in Serve's
# controller (autoscale/serve_policy.py): its latest decision per deployment (label `deployment`), pushed to the
# app's hub
M_AUTOSCALER_TARGET = "affinity_autoscaler_target_replicas"
M_AUTOSCALER_CURRENT = "affinity_autoscaler_current_replicas"
M_AUTOSCALER_UP_TARGET = "affinity_autoscaler_up_target"
M_AUTOSCALER_DOWN_TARGET = "affinity_autoscaler_down_target"
M_AUTOSCALER_LOAD = "affinity_autoscaler_load_units"
M_AUTOSCALER_PREFILL = "affinity_autoscaler_prefill_units"
M_AUTOSCALER_DECODE = "affinity_autoscaler_decode_units"
M_AUTOSCALER_KV = "affinity_autoscaler_kv_units"
M_AUTOSCALER_TREND = "affinity_autoscaler_trend_units"
M_AUTOSCALER_DECISIONS = "affinity_autoscaler_decisions"

#: labels renamed on the vLLM aliases (vLLM's dashboards filter on `model_name`)
VLLM_LABELS = {"model": "model_name", "finish_reason": "finished_reason"}


class Kind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric. `name` is the OpenTelemetry instrument's; Prometheus sees `family` (plus `_total` on a
    counter, `_bucket`/`_sum`/`_count` on a histogram). `vllm`: vLLM's families for the same quantity,
    exported as aliases with the labels in VLLM_LABELS renamed."""

    name: str
    kind: Kind
    description: str
    unit: str = ""
    vllm: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return self.name + ("_seconds" if self.unit == "s" else "")

    def series(self, family: str | None = None) -> list[str]:
        """The sample names Prometheus stores for this metric (or for one of its aliases)."""
        f = family or self.family
        if self.kind is Kind.COUNTER:
            return [f"{f}_total"]
        if self.kind is Kind.HISTOGRAM:
            return [f"{f}_bucket", f"{f}_sum", f"{f}_count"]
        return [f]


def _c(name: str, description: str, *vllm: str) -> MetricSpec:
    return MetricSpec(name, Kind.COUNTER, description, vllm=vllm)


def _g(name: str, description: str, *vllm: str) -> MetricSpec:
    return MetricSpec(name, Kind.GAUGE, description, vllm=vllm)


def _h(name: str, description: str, unit: str, *vllm: str) -> MetricSpec:
    return MetricSpec(name, Kind.HISTOGRAM, description, unit, vllm)


METRICS: dict[str, MetricSpec] = {m.name: m for m in [
    _h(M_TTFT, "time to first token, at the ingress", "s", "vllm:time_to_first_token_seconds"),
    _h(M_TPOT, "time per output token, one sample per sequence: (last token - first) / (tokens - 1)", "s",
       "vllm:request_time_per_output_token_seconds"),
    _h(M_E2E, "end-to-end request latency, at the ingress", "s", "vllm:e2e_request_latency_seconds"),
    _c(M_PROMPT_TOKENS, "prompt tokens", "vllm:prompt_tokens"),
    _c(M_GEN_TOKENS, "generated tokens", "vllm:generation_tokens"),
    _c(M_CACHED_TOKENS, "prompt tokens found in a replica's prefix cache"),
    _h(M_REQUEST_PROMPT_TOKENS, "prompt tokens per request", "", "vllm:request_prompt_tokens"),
    _h(M_REQUEST_GEN_TOKENS, "generated tokens per request", "", "vllm:request_generation_tokens"),
    _c(M_HTTP, "HTTP responses by route and status"),
    _c(M_HANDLE, "Python DeploymentHandle calls of the inference methods by method and status"),
    _c(M_ROUTING_DECISIONS, "routing decisions by reason (affinity, released, ...)"),
    _h(M_ROUTING_DECISION_TIME, "router decision time (wall)", "s"),
    _c(M_ROUTING_PREDICTED_CACHED, "cached prompt tokens the router predicted, on the replica the request ran "
       "on (decisions whose engine reported its cached tokens)"),
    _c(M_ROUTING_ACTUAL_CACHED, "cached prompt tokens the engine found, for the same decisions (index accuracy "
       "= actual / predicted)"),
    _c(M_ROUTING_FEED_PULLS, "a router's KV event pulls by outcome (ok, timed_out: no answer within "
       "routing.kv_events_timeout_s, error)"),
    _c(M_ROUTING_FEED_EVENTS, "KV events a router's feed applied to its prefix index"),
    _c(M_ROUTING_FEED_SNAPSHOTS, "whole KV snapshots a router's feed applied (a replica new, restarted, reset or "
       "out of sequence)"),
    _g(M_ROUTING_FEED_TIMEOUT_STREAK, "a replica's KV event pulls that timed out in a row, per router (0 once one "
       "answers)"),
    MetricSpec(M_ROUTING_FEED_LAG, Kind.GAUGE, "seconds since a replica last answered a router's KV event pull "
               "(since the feed first asked, if never): the router's index can miss what it cached since", "s"),
    _g(M_ROUTING_FEED_PAUSED, "1 while a router's KV event feed is paused (it routed nothing for "
       "routing.kv_events_idle_s: it pulls nothing and its index is empty until it routes again), else 0"),
    _g(M_ROUTING_INDEX_ENTRIES, "block hashes a router's prefix index holds now, by index (pool: replicas' KV "
       "pools; tier: offload tiers and node-shared stores)"),
    _g(M_ROUTING_INDEX_CAPACITY, "the bound on a router's index entries now, by index (pool: the replicas' "
       "reported pool blocks x affinity.index_capacity_margin, at most affinity.max_index_entries)"),
    _c(M_ROUTING_INDEX_EVICTIONS, "entries a router's index dropped at its bound, by index (oldest first)"),
    _c(M_ROUTING_INDEX_RESYNCS, "replicas whose index entries a router dropped for a gap, an epoch change or a "
       "cleared cache (a snapshot rebuilds them)"),
    _c(M_ROUTING_ERRORS, "routing decisions that fell back to a load-only ranking after an internal error, by "
       "where (core, shell)"),
    _c(M_ROUTING_REROUTED, "requests Serve sent to a replica other than the router's first choice (it was full)"),
    _g(M_RUNNING, "running requests per replica", "vllm:num_requests_running"),
    _g(M_WAITING, "waiting requests per replica", "vllm:num_requests_waiting"),
    _g(M_KV_USAGE, "KV cache usage (0-1) per replica", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    _g(M_PREFIX_HIT, "prefix-cache hit rate per replica since it started"),
    _g(M_PREFIX_HIT_RECENT, "prefix-cache hit rate per replica over its recent requests"),
    _c(M_PREFIX_QUERIES, "prompt tokens looked up in the prefix cache", "vllm:prefix_cache_queries"),
    _c(M_PREFIX_HITS, "prompt tokens found in the prefix cache", "vllm:prefix_cache_hits"),
    _c(M_PREEMPTIONS, "preemptions (a running request's KV blocks taken back)", "vllm:num_preemptions"),
    _h(M_QUEUE_TIME, "time a sequence waited before its first step, in the replica", "s",
       "vllm:request_queue_time_seconds"),
    _h(M_PREFILL_TIME, "first step to first token, in the replica", "s", "vllm:request_prefill_time_seconds"),
    _h(M_DECODE_TIME, "first token to last, in the replica", "s", "vllm:request_decode_time_seconds"),
    _c(M_FINISHED, "sequences finished, by finish reason (stop, length, abort, error, ...)",
       "vllm:request_success"),
    _c(M_KV_TIER_LOOKUPS, "KV tier lookups (admissions that asked the tier)"),
    _c(M_KV_TIER_HIT_BLOCKS, "KV blocks the tier held at lookup"),
    _c(M_KV_TIER_HIT_TOKENS, "prompt tokens the tier held at lookup"),
    _c(M_KV_TIER_LOADS, "loads from the tier that completed"),
    _c(M_KV_TIER_LOADED_BLOCKS, "KV blocks loaded from the tier"),
    _c(M_KV_TIER_LOAD_FAILURES, "loads that failed (the request recomputed), by cause"),
    _c(M_KV_TIER_STORED_BLOCKS, "KV blocks written to the tier"),
    _c(M_KV_TIER_STORE_FAILURES, "KV blocks whose write to the tier failed"),
    _c(M_KV_TIER_EVICTED_BLOCKS, "KV blocks the tier evicted"),
    _c(M_KV_TIER_BYTES, "bytes moved between the pool and the tier, by direction"),
    _c(M_PD_TRANSFERS, "P/D, decode side: prefilled requests by outcome (read: KV read from the prefill side; "
       "local: every block was cached here, nothing read; failed: the read failed, recomputed here)"),
    _c(M_PD_TRANSFER_BLOCKS, "P/D, decode side: KV blocks read from the prefill side"),
    _c(M_PD_TRANSFER_BYTES, "P/D, decode side: bytes of KV read from the prefill side"),
    _h(M_PD_TRANSFER_TIME, "P/D, decode side: a KV read's start to its blocks in the pool (reads that succeeded)",
       "s"),
    _c(M_PD_FALLBACKS, "P/D, decode side: requests recomputed here instead of continuing a remote prefill, by cause "
       "(missing, damaged, timed_out, error: the KV read; prefill_failed: the prefill pool's call)"),
    _c(M_PD_HOLDS, "P/D, prefill side: holds of prefilled KV ended, by outcome (read, released: the decode side "
       "needed none, expired: unread at transfer_timeout_s)"),
    _h(M_PD_HOLD_TIME, "P/D, prefill side: first token to the hold's blocks freed, by outcome", "s"),
    _g(M_PD_HELD_BLOCKS, "P/D, prefill side: KV blocks held now for decode replicas to read"),
    _g(M_AUTOSCALER_TARGET, "the replica count the autoscaling policy's latest decision asks Serve for"),
    _g(M_AUTOSCALER_CURRENT, "the replicas running at that decision (Serve's current_num_replicas: not those "
       "starting)"),
    _g(M_AUTOSCALER_UP_TARGET, "what the policy's up rule wanted at its latest decision (before delays and bounds)"),
    _g(M_AUTOSCALER_DOWN_TARGET, "the fewest replicas the policy's down rule would allow at its latest decision"),
    _g(M_AUTOSCALER_LOAD, "the fleet's load at the policy's latest decision, in replicas (prefill + decode units)"),
    _g(M_AUTOSCALER_PREFILL, "of the load, prefill: (prefill rate + backlog / TTFT SLO) over one replica's rate"),
    _g(M_AUTOSCALER_DECODE, "of the load, decode: sequences running and queued over one replica's decode capacity"),
    _g(M_AUTOSCALER_KV, "held KV over the KV usage target, in replicas"),
    _g(M_AUTOSCALER_TREND, "the rising trend's extra load at the lead time ahead, in replicas (the predicted load is "
       "load + trend)"),
    _c(M_AUTOSCALER_DECISIONS, "autoscaling policy decisions by reason, one per policy call (rate() by reason: the "
       "share of time in each)"),
]}


def exported_series(vllm_aliases: bool = True) -> set[str]:
    """Every sample name `/metrics` can show (a Grafana query may name only these)."""
    out: set[str] = set()
    for m in METRICS.values():
        out.update(m.series())
        if vllm_aliases:
            for alias in m.vllm:
                out.update(m.series(alias))
    return out
