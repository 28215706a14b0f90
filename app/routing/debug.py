"""The routers living in this process, and their decisions and index state as JSON-able dicts.

Serve builds one router per (process, deployment handle), on its own event loop thread, and pickles the
router class by value: this module (imported by reference, so one copy per process) is where routers
register themselves so the ingress's debug methods can find the one routing its handle's requests.
"""
from __future__ import annotations

import weakref
from typing import Any

from app.routing.api import Decision

_ROUTERS: dict[str, list[weakref.ref]] = {}


def register(app_name: str, deployment_name: str, router: Any) -> None:
    _ROUTERS.setdefault(f"{app_name}#{deployment_name}", []).append(weakref.ref(router))


def routers_for(app_name: str, deployment_name: str) -> list[Any]:
    """Live routers of a deployment in this process, oldest first."""
    refs = _ROUTERS.get(f"{app_name}#{deployment_name}", [])
    live = [r() for r in refs]
    return [r for r in live if r is not None]


def decision_to_dict(d: Decision) -> dict[str, Any]:
    return {"request_id": d.request_id, "chosen": d.chosen, "ranked": list(d.ranked), "reason": d.reason.value,
            "affinity_replica_id": d.affinity_replica_id, "num_hot_replicas": d.num_hot_replicas,
            "decision_time_s": d.decision_time_s,
            "candidates": [{"replica_id": c.replica_id, "predicted_cached_tokens": c.predicted_cached_tokens,
                            "predicted_ttft_s": c.predicted_ttft_s, "queued_prefill_tokens": c.queued_prefill_tokens,
                            "decode_load": c.decode_load, "kv_usage": c.kv_usage} for c in d.candidates]}
