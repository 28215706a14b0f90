"""The routers living in this process, and their decisions and index state as JSON-able dicts.

Serve builds one router per (process, deployment handle), on its own event loop thread, and pickles the
router class by value: this module (imported by reference, so one copy per process) is where routers
register themselves so the ingress's debug methods can find the one routing its handle's requests.

A router leaves each decision on the request itself (`GenerateRequest.routing`, which stays in this
process); `routing_record` turns it into what the request's `llm.routing` span and the routing metrics say.

The routers' own counters (KV event feed, prefix index, errors) reach /metrics through the process's
telemetry: the first router registered in a process that set it up adds `RouterMetrics`, which reads every
live router's latest `metrics_sample` (left on its own loop) at each collection.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

from affinity_serve.app.routing.api import Decision
from affinity_serve.observability.metrics import RouterMetrics, RouterSample
from affinity_serve.observability.requests import RoutingRecord
from affinity_serve.observability.setup import current_telemetry

#: "app#deployment" -> (router, its number among the process's routers of the deployment), oldest first
_ROUTERS: dict[str, list[tuple[weakref.ref, int]]] = {}
_num_registered: dict[str, int] = {}  # deployment name -> routers of it registered in this process so far
_registry_lock = threading.Lock()
_metrics_lock = threading.Lock()
_metrics_provider: Any = None          # the MeterProvider RouterMetrics was added to (one per process)


def register(app_name: str, deployment_name: str, router: Any) -> bool:
    """Find `router` by its deployment from now on; True when this process exports routers' metrics (then it
    should leave a `metrics_sample` now and then). Its number (its metrics label's) is never given to another
    router of the deployment in this process, so RouterMetrics can tell a router gone from one relabelled."""
    key = f"{app_name}#{deployment_name}"
    with _registry_lock:
        n = _num_registered.get(deployment_name, 0)
        _num_registered[deployment_name] = n + 1
        live = [(ref, i) for ref, i in _ROUTERS.get(key, []) if ref() is not None]
        _ROUTERS[key] = [*live, (weakref.ref(router), n)]
    return install_router_metrics()


def install_router_metrics() -> bool:
    """Add RouterMetrics (reading `router_samples`) to this process's telemetry, once per meter provider;
    False where the process has none (a driver's handle: its routers are not on any /metrics)."""
    global _metrics_provider
    telemetry = current_telemetry()
    if telemetry is None:
        return False
    with _metrics_lock:
        if _metrics_provider is not telemetry.meter_provider:
            RouterMetrics(telemetry.meter, router_samples)
            _metrics_provider = telemetry.meter_provider
    return True


def router_samples() -> list[tuple[str, RouterSample]]:
    """(router label, latest sample) of each live router in this process that has left one (any thread).
    The label is the Serve replica hosting the process, so it tells the app's routers apart; a further
    router of the same deployment in the process (a second handle) gets `:<n>` after it, n its number
    (register), kept for its life."""
    host = _host_label()
    out: list[tuple[str, RouterSample]] = []
    for entries in list(_ROUTERS.values()):
        for ref, n in entries:
            sample = getattr(ref(), "metrics_sample", None)
            if sample is not None:
                out.append((host if n == 0 else f"{host}:{n}", sample))
    return out


@functools.cache
def _host_label() -> str:
    from affinity_serve.app.metrics_hub import serve_app_and_replica
    ctx = serve_app_and_replica()
    return ctx[1] if ctx else "local"


def routers_for(app_name: str, deployment_name: str) -> list[Any]:
    """Live routers of a deployment in this process, oldest first."""
    entries = _ROUTERS.get(f"{app_name}#{deployment_name}", [])
    live = [ref() for ref, _ in entries]
    return [r for r in live if r is not None]


def decision_to_dict(d: Decision) -> dict[str, Any]:
    return {"req_id": d.req_id, "chosen": d.chosen, "ranked": list(d.ranked), "reason": d.reason.value,
            "affinity_replica_id": d.affinity_replica_id, "num_hot_replicas": d.num_hot_replicas,
            "decision_time_s": d.decision_time_s,
            "candidates": [{"replica_id": c.replica_id, "predicted_cached_tokens": c.predicted_cached_tokens,
                            "predicted_tier_cached_tokens": c.predicted_tier_cached_tokens,
                            "predicted_ttft_s": c.predicted_ttft_s, "queued_prefill_tokens": c.queued_prefill_tokens,
                            "decode_load": c.decode_load, "kv_usage": c.kv_usage} for c in d.candidates]}


def routing_record(d: Decision, replica_id: str, num_cached_tokens: int | None) -> RoutingRecord:
    """The decision as telemetry reports it, with where the request actually ran (Serve walks down the
    ranks when a replica is full) and what the engine found cached there."""
    s = d.scores
    ran = s.replica_ids.index(replica_id) if replica_id in s.replica_ids else None
    chosen = s.replica_ids.index(d.chosen) if d.chosen in s.replica_ids else None
    return RoutingRecord(
        reason=d.reason.value, chosen=d.chosen, replica_id=replica_id or d.chosen,
        affinity_replica_id=d.affinity_replica_id, decision_time_s=d.decision_time_s,
        predicted_cached_tokens=s.predicted_cached_tokens[ran] if ran is not None else 0,
        actual_cached_tokens=num_cached_tokens,
        predicted_ttft_s=s.predicted_ttft_s[chosen] if chosen is not None else None,
        candidate_ids=list(s.replica_ids), candidate_predicted_cached_tokens=list(s.predicted_cached_tokens),
        candidate_predicted_ttft_s=list(s.predicted_ttft_s),
        candidate_queued_prefill_tokens=list(s.queued_prefill_tokens),
        candidate_num_running=list(s.decode_load), candidate_kv_cache_usage=list(s.kv_usage),
        candidate_predicted_tier_cached_tokens=[s.tier_cached(i) for i in range(len(s))])
