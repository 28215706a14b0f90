"""Everything this project takes from Ray Serve's private surface, in one place (pinned for Ray 2.60 by
tests/unit/app/test_serve_compat.py, so an upgrade that moves any of it fails there, not in routing).

- `ReplicaMethodClient`: calls a deployment method on ONE chosen replica, off the routing path (the KV event
  feed, snapshots, warm-ups). Serve has no public per-replica call: this goes through the replica actor's
  own request entry point (`handle_request`) with a pickled `RequestMetadata` naming the method, as Serve's
  router does for a non-streaming request.
- `pending_args` / `internal_request_id`: what a `PendingRequest` carries (the call's positional arguments,
  Serve's own id for the call).
"""
from __future__ import annotations

import asyncio
import pickle
import uuid
from typing import Any

import ray
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from app.routing.feed import KV_FEED_REQUEST_ID_PREFIX
from engine.types import KVCacheSnapshot, KVEventsReply


class ReplicaMethodClient:
    """Calls a deployment method on ONE replica: Serve's request entry point on the replica actor
    (`handle_request`) with a RequestMetadata naming the method (ActorReplicaWrapper.send_request_python
    without rejection)."""

    def __init__(self, replica: RunningReplica) -> None:
        self._actor = replica._actor_handle          # noqa: SLF001 - Serve keeps no public handle to it
        self._app_name = replica.replica_id.deployment_id.app_name

    async def events_since(self, next_seq: int, epoch: str | None) -> KVEventsReply:
        return await self._call("kv_events_since", next_seq, epoch)

    async def snapshot(self) -> KVCacheSnapshot:
        return await self._call("kv_snapshot")

    async def warm(self, prompts: list[list[int]]) -> dict[str, Any]:
        return await self._call("warm", prompts)

    async def _call(self, method: str, *args: Any) -> Any:
        meta = RequestMetadata(request_id=f"{KV_FEED_REQUEST_ID_PREFIX}{method}",
                               internal_request_id=uuid.uuid4().hex, call_method=method, app_name=self._app_name)
        ref = self._actor.handle_request.remote(pickle.dumps(meta), *args)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise


def pending_args(pending_request: PendingRequest | None) -> tuple:
    """The call's positional arguments (empty for none, e.g. Serve's pre-warm call)."""
    if pending_request is None:
        return ()
    return tuple(getattr(pending_request, "args", None) or ())


def internal_request_id(pending_request: PendingRequest) -> str:
    """Serve's own id of the call (what on_request_completed reports back)."""
    return pending_request.metadata.internal_request_id
