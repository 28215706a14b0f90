"""A replica's load as Serve carries it to routers: a few of `EngineLoad`'s fields, by their names, as a
small JSON-able dict (`routing_stats`), and its gauges for the metrics exporter (`load_sample`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from affinity_serve.observability.metrics import ReplicaLoadSample

if TYPE_CHECKING:
    from affinity_serve.engine import EngineLoad

#: the EngineLoad fields in the routing stats. Serve's controller polls `record_routing_stats()` and
#: rebroadcasts every replica's stats to every router whenever one changes, so this stays a handful of numbers
ROUTING_STATS_FIELDS = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_queued_prefill_tokens",
                        "prefix_cache_queries_total", "prefix_cache_hits_total", "recent_prefix_cache_queries",
                        "recent_prefix_cache_hits", "cache_epoch", "num_blocks", "kv_wait_s")


def routing_stats(load: EngineLoad) -> dict[str, Any]:
    """`load`'s ROUTING_STATS_FIELDS (KV usage rounded to 4 digits), and `taken_at`: the wall clock
    (time.time()) when the engine's load was read, so a router counts the requests it sent after it on top.
    Routers read it with `app.routing.ReplicaLoadView.from_stats`."""
    stats = {f: getattr(load, f) for f in ROUTING_STATS_FIELDS}
    stats["kv_cache_usage"] = round(load.kv_cache_usage, 4)
    stats["kv_wait_s"] = round(load.kv_wait_s, 4)
    step = step_time_s(load)
    if step is not None:
        stats["step_time_s"] = step
    stats["taken_at"] = round(time.time() - max(0.0, time.monotonic() - load.timestamp), 4)
    return stats


def step_time_s(load: EngineLoad) -> float | None:
    """Mean duration of the engine's recent steps that decoded (0.1 ms resolution), None without one: how long
    a running sequence waits for each of its tokens here, which the router's admission control takes as the
    time a sequence holds its KV blocks per output token until it has seen requests finish."""
    times = [s.step_time_s for s in load.recent_steps if s.num_decode_seqs > 0]
    return round(sum(times) / len(times), 4) or 0.0001 if times else None


def load_sample(load: EngineLoad) -> ReplicaLoadSample:
    """A replica's gauges and load counters (observability.metrics.ReplicaMetrics) from the engine's load."""
    return ReplicaLoadSample(num_running=load.num_running_reqs, num_waiting=load.num_waiting_reqs,
                             kv_cache_usage=load.kv_cache_usage, prefix_hit_rate=load.prefix_hit_rate,
                             recent_prefix_hit_rate=load.recent_prefix_hit_rate,
                             prefix_cache_queries_total=load.prefix_cache_queries_total,
                             prefix_cache_hits_total=load.prefix_cache_hits_total,
                             num_preemptions_total=load.num_preemptions_total)
