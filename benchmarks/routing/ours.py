"""Our router in the simulator: the pure core from app/routing driven the way the Ray Serve shell drives it.

Per request: `route(RouteRequest(block hashes from the ingress), all replicas)`; the first token reports
the engine's cached-token count (`on_first_token`), the end `on_finished`. Per replica, every events
period: the KV events since the last pull (`kv_events_since`), or a snapshot when the core or the replica
asks for one (new replica, gap, epoch change); every stats period: the stats snapshot (`on_stats`). The
core's clock is the simulation's.
"""
from __future__ import annotations

import random

from affinity_serve.app.routing import AffinityConfig, ReplicaInfo, ReplicaLoadView, RouteRequest, make_core
from benchmarks.routing.replica import ReplicaSpec, SimReplica
from benchmarks.routing.routers import ClusterView, SimRequest, _Base, pull_kv_events


class OursRouter(_Base):
    def __init__(self, replica: ReplicaSpec, config: AffinityConfig | None = None,
                 policy: str = "prefix_affinity", name: str = "ours (prefix affinity)",
                 declared_max_tokens: int = 0):
        self.block_size = replica.block_size
        self.config = config or AffinityConfig()
        self.policy = policy
        self.name = name
        #: the max_tokens every request declares (0: its own output length, as if the client knew it);
        #: a chat client that sets none gets max_model_len - prompt from the server
        self.declared_max_tokens = declared_max_tokens

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.now = 0.0
        self.core = make_core(self.policy, self.config, self.block_size, clock=lambda: self.now,
                              rng=random.Random(seed))
        self.ids = [f"replica-{i:03d}" for i in range(self.n)]
        self.index_of = {rid: i for i, rid in enumerate(self.ids)}
        self.core.set_replicas([ReplicaInfo(rid) for rid in self.ids])
        self.next_seq: list[int | None] = [None] * self.n
        self.epoch: list[str | None] = [None] * self.n
        self.output_len: dict[str, int] = {}

    def route(self, req: SimRequest, now: float) -> int:
        self.now = now
        # A client's max_tokens is an upper bound (often unset): the trace's output length is what the
        # shell reports at the end (on_finished), not what the request declares.
        self.output_len[req.req_id] = req.max_tokens
        d = self.core.route(RouteRequest(req.req_id, req.block_hashes, len(req.prompt_token_ids),
                                         self.declared_max_tokens or req.max_tokens), self.ids)
        return self.index_of[d.chosen]

    def on_first_token(self, req_id: str, replica: int, num_cached_tokens: int, now: float,
                       kv_wait_s: float = 0.0) -> None:
        self.now = now
        self.core.on_first_token(req_id, num_cached_tokens, kv_wait_s)

    def on_finished(self, req_id: str, replica: int, now: float) -> None:
        self.now = now
        self.core.on_finished(req_id, self.output_len.pop(req_id, None))

    def on_stats(self, replica: int, feed: SimReplica, now: float) -> None:
        self.now = now
        self.core.on_stats(self.ids[replica], ReplicaLoadView.from_stats(feed.load_view()))

    def on_kv_events(self, replica: int, feed: SimReplica, now: float) -> None:
        self.now = now
        pull_kv_events(replica, feed, self.ids, self.next_seq, self.epoch, self.core.replicas_needing_snapshot,
                       self.core.on_kv_events, self.core.on_snapshot)

    def summary(self) -> dict:
        """The core's own counters: decisions by reason, index accuracy, the calibrated TTFT model."""
        c = self.core.counters()
        return {"decisions_by_reason": {r.value: n for r, n in c.num_by_reason.items()},
                "errors": c.num_errors, "index_accuracy": c.index_accuracy, "resyncs": c.num_resyncs,
                "index_entries": c.num_index_entries, "prefill_tokens_per_s": c.prefill_tokens_per_s,
                "decode_step_s": c.decode_step_s}
