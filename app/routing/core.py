"""PrefixAffinityRouterCore: the facade over PrefixIndex + AffinityPolicy that a router shell or simulator drives."""
from __future__ import annotations

import random
import time
from collections.abc import Callable

from app.routing.api import (Decision, KVEventBatch, KVSnapshot, ReplicaInfo, ReplicaLoadView, RouterCounters,
                             RouteRequest)
from app.routing.config import AffinityConfig


class PrefixAffinityRouterCore:
    """The prefix-affinity policy (implements api.RouterCore; see its method contracts).

    `block_size` must be the engines' KV block size (the hashes in RouteRequest are per full block of it).
    `clock` returns seconds (monotonic); `rng` breaks near-ties. Both injectable for simulators and tests.
    """

    def __init__(self, config: AffinityConfig, block_size: int,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        raise NotImplementedError

    def set_replicas(self, replicas: list[ReplicaInfo]) -> None:
        raise NotImplementedError

    def on_stats(self, replica_id: str, load: ReplicaLoadView) -> None:
        raise NotImplementedError

    def on_kv_events(self, batch: KVEventBatch) -> bool:
        raise NotImplementedError

    def replicas_needing_snapshot(self) -> list[str]:
        raise NotImplementedError

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        raise NotImplementedError

    def route(self, request: RouteRequest, candidate_ids: list[str]) -> Decision:
        raise NotImplementedError

    def on_routed(self, request_id: str, replica_id: str) -> None:
        raise NotImplementedError

    def on_first_token(self, request_id: str, num_cached_tokens: int | None = None) -> None:
        raise NotImplementedError

    def on_actual_cached(self, request_id: str, num_cached_tokens: int) -> None:
        raise NotImplementedError

    def on_finished(self, request_id: str) -> None:
        raise NotImplementedError

    def recent_decisions(self, n: int) -> list[Decision]:
        raise NotImplementedError

    def counters(self) -> RouterCounters:
        raise NotImplementedError
