"""The routers living in this process, and their decisions and index state as JSON-able dicts.

Serve builds one router per (process, deployment handle), on its own event loop thread, and pickles the
router class by value: this module (imported by reference, so one copy per process) is where routers
register themselves so the ingress's debug methods can find the one routing its handle's requests.

A router leaves each decision on the request itself (`GenerateRequest.routing`, which stays in this
process); `routing_record` turns it into what the request's `llm.routing` span and the routing metrics say.
"""
from __future__ import annotations

import weakref
from typing import Any

from affinity_serve.app.routing.api import Decision
from affinity_serve.observability.requests import RoutingRecord

_ROUTERS: dict[str, list[weakref.ref]] = {}


def register(app_name: str, deployment_name: str, router: Any) -> None:
    _ROUTERS.setdefault(f"{app_name}#{deployment_name}", []).append(weakref.ref(router))


def routers_for(app_name: str, deployment_name: str) -> list[Any]:
    """Live routers of a deployment in this process, oldest first."""
    refs = _ROUTERS.get(f"{app_name}#{deployment_name}", [])
    live = [r() for r in refs]
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
