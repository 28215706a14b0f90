"""Everything this project takes from Ray Serve's private surface, in one place (pinned for Ray 2.60 by
tests/unit/app/test_serve_compat.py, so an upgrade that moves any of it fails there, not in routing).

- `ReplicaMethodClient`: calls a deployment method on ONE chosen replica, off the routing path (the KV event
  feed, snapshots, warm-ups). Serve has no public per-replica call: this goes through the replica actor's
  own request entry point (`handle_request`) with a pickled `RequestMetadata` naming the method, as Serve's
  router does for a non-streaming request.
- `pending_args` / `internal_request_id`: what a `PendingRequest` carries (the call's positional arguments,
  Serve's own id for the call).
- `DropKVFeedAccessLogs`: a filter on Serve's logger that knows the attributes of Serve's access records.
- `handle_has_known_replicas`: whether a DeploymentHandle's router has once received a non-empty replica set
  (`DeploymentHandle.running_replicas_populated`, undocumented).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import uuid
from typing import Any

import ray
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from affinity_serve.app.routing.feed import KV_FEED_REQUEST_ID_PREFIX
from affinity_serve.engine.types import KVCacheSnapshot, KVEventsReply


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


class DropKVFeedAccessLogs(logging.Filter):
    """Drops Serve's access-log lines for the routers' KV feed pulls: every router calls every replica
    several times a second, which would bury the real requests. Serve's replica logs one access record per
    call on the "ray.serve" logger with `serve_access_log` and `request_id` set (ray/serve/_private/
    replica.py, `_access_log_context`); other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None)
        return not (getattr(record, "serve_access_log", False) and isinstance(request_id, str)
                    and request_id.startswith(KV_FEED_REQUEST_ID_PREFIX))


def drop_kv_feed_access_logs() -> None:
    """Install DropKVFeedAccessLogs on Serve's logger (a logger filter: Serve logs access records on that
    logger itself). Idempotent."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, DropKVFeedAccessLogs) for f in serve_logger.filters):
        serve_logger.addFilter(DropKVFeedAccessLogs())


def handle_has_known_replicas(handle: Any) -> bool:
    """Whether `handle`'s router (made by its first call) has once received a non-empty replica set from
    Serve's controller; False for anything that is not a DeploymentHandle."""
    populated = getattr(handle, "running_replicas_populated", None)
    return bool(populated()) if callable(populated) else False
