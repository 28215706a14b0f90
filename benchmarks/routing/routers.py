"""The routers the simulator compares, behind one small interface (`SimRouter`).

- round-robin; power-of-two (the less loaded of two random replicas; load = requests in flight there);
- Ray Serve LLM's `PrefixCacheAffinityRouter`: its real code, driven offline (../shared/RAY_SERVE_NOTES.md
  §4.3): the module's `ray` is swapped for a shim whose `get` returns its argument and the prefix tree
  is a local `PrefixTree` behind an object that answers `method.remote(...)`. It matches characters, so
  it sees a text rendering of the token ids (one fixed 2-6 letter word per token id);
- ours: the pure routing core in app/routing, fed stats snapshots and KV events periodically as the real
  shell feeds it (benchmarks/routing/ours.py);
- oracles: `shared` (every replica hits one shared infinite cache; least-loaded placement) and
  `pinned` (prefix groups pinned by the footprint-balanced partition that the separate-caches bound uses).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import numpy as np

from benchmarks.routing.replica import SimReplica
from affinity_serve.engine.hashing import BlockHash


@dataclass(slots=True)
class SimRequest:
    """What a router may look at: the request as the ingress has it (token ids and their block hashes)."""

    req_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]      # full blocks of the prompt, the engine's own hash
    max_tokens: int                    # the request's output length (as a client's max_tokens)
    group: str                         # for the pinned oracle only; real routers never read it


class ClusterView:
    """Live facts every router could know exactly without asking a replica: what it sent where and what
    finished (one ingress). `ongoing[i]` = requests in flight on replica i."""

    def __init__(self, num_replicas: int):
        self.ongoing = [0] * num_replicas


class SimRouter(Protocol):
    name: str
    #: the simulator builds the replicas on one shared infinite cache (the shared-cache oracle)
    shared_cache: bool

    def setup(self, cluster: ClusterView, seed: int) -> None: ...

    def route(self, req: SimRequest, now: float) -> int:
        """The replica index for `req` (called once per request, on release)."""

    def on_first_token(self, req_id: str, replica: int, num_cached_tokens: int, now: float,
                       kv_wait_s: float = 0.0) -> None: ...

    def on_finished(self, req_id: str, replica: int, now: float) -> None: ...

    def on_kv_events(self, replica: int, feed: SimReplica, now: float) -> None:
        """Time for this router's periodic KV-event pull of one replica: `feed.kv_events_since()` and
        `feed.kv_snapshot()` answer as the real replica's pull API does."""

    def on_stats(self, replica: int, feed: SimReplica, now: float) -> None:
        """A fresh stats snapshot of one replica is available: `feed.load_view()`."""


class _Base:
    shared_cache = False

    def setup(self, cluster: ClusterView, seed: int) -> None:
        self.cluster = cluster
        self.n = len(cluster.ongoing)
        self.rng = random.Random(seed)

    # Feedback hooks: the baseline routers (round-robin, power-of-two, oracles) use none of them.
    def on_first_token(self, req_id: str, replica: int, num_cached_tokens: int, now: float,
                       kv_wait_s: float = 0.0) -> None:
        """Ignored by default."""

    def on_finished(self, req_id: str, replica: int, now: float) -> None:
        """Ignored by default."""

    def on_kv_events(self, replica: int, feed: SimReplica, now: float) -> None:
        """Ignored by default."""

    def on_stats(self, replica: int, feed: SimReplica, now: float) -> None:
        """Ignored by default."""

    def least_loaded(self) -> int:
        q = self.cluster.ongoing
        low = min(q)
        return self.rng.choice([i for i, v in enumerate(q) if v == low])


class RoundRobin(_Base):
    name = "round-robin"

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.next = 0

    def route(self, req: SimRequest, now: float) -> int:
        i, self.next = self.next, (self.next + 1) % self.n
        return i


class PowerOfTwo(_Base):
    name = "power-of-two"

    def route(self, req: SimRequest, now: float) -> int:
        if self.n == 1:
            return 0
        i, j = self.rng.sample(range(self.n), 2)
        q = self.cluster.ongoing
        return i if q[i] <= q[j] else j


class SharedCacheOracle(_Base):
    """Upper bound: every replica reads one shared infinite cache, so placement is pure load balance."""

    name = "oracle: shared cache"
    shared_cache = True

    def route(self, req: SimRequest, now: float) -> int:
        return self.least_loaded()


class PinnedOracle(_Base):
    """Prefix groups pinned to replicas by the footprint-balanced partition (the separate-caches bound)."""

    name = "oracle: pinned groups"

    def __init__(self, assignment: dict[str, int]):
        self.assignment = assignment

    def route(self, req: SimRequest, now: float) -> int:
        return self.assignment[req.group or req.req_id]


# ================================================================== Ray's PrefixCacheAffinityRouter
class TokenText:
    """A fixed text rendering of token ids: " " + a 2-6 letter word per id (about 5 characters a token,
    like English BPE text), so a character prefix match is a token prefix match."""

    def __init__(self, vocab_size: int = 32000, seed: int = 0):
        rng = np.random.default_rng(seed)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        lengths = rng.integers(2, 7, vocab_size)
        self.words = [" " + "".join(rng.choice(letters, k)) for k in lengths]

    def render(self, token_ids: list[int]) -> str:
        w = self.words
        return "".join([w[t] for t in token_ids])


class RayPrefixAffinity(_Base):
    """Ray Serve LLM 2.60's router, its real `choose_replicas` and `on_request_routed`, run offline.

    Queue lengths: the router's queue-length cache is kept exact (updated on every send and completion),
    so it never needs to probe. The base class picks the replica with the shortest queue among those
    `choose_replicas` returns in rank 0, as Serve does; `max_ongoing_requests` is not binding here.
    """

    def __init__(self, imbalanced_threshold: float = float("inf"), text: TokenText | None = None):
        self.imbalanced_threshold = imbalanced_threshold
        thr = "inf (default)" if imbalanced_threshold == float("inf") else f"{imbalanced_threshold:g}"
        self.name = f"ray prefix-aware, imbalance {thr}"
        self.text = text or TokenText()

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        random.seed(seed)            # Ray's power-of-two fallback draws from the module-level RNG
        import ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router as par
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
        from ray.serve._private.request_router.common import PendingRequest

        par.ray = SimpleNamespace(get=lambda x: x)
        self._PendingRequest, self._RequestMetadata = PendingRequest, RequestMetadata
        self.now = 0.0
        dep = DeploymentID(name="engine", app_name="bench")
        self.router = par.PrefixCacheAffinityRouter(
            deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True,
            get_curr_time_s=lambda: self.now)
        self.router.initialize_state(imbalanced_threshold=self.imbalanced_threshold, tree_actor=_TreeShim(PrefixTree()))
        self.replicas = [_FakeReplica(ReplicaID(unique_id=f"r{i:03d}", deployment_id=dep), i, cluster)
                         for i in range(self.n)]
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._update_replicas())
        for r in self.replicas:
            self.router.on_new_queue_len_info(r.replica_id, 0)

    async def _update_replicas(self) -> None:
        self.router.update_replicas(self.replicas)

    async def _choose(self, prompt, md):
        # PendingRequest makes an asyncio.Future on construction: build it on the router's loop (outside a
        # running loop there may be no current one, e.g. after pytest-asyncio tests closed theirs).
        pr = self._PendingRequest(args=[prompt], kwargs={}, metadata=md)
        ranks = await self.router.choose_replicas(candidate_replicas=list(self.router.curr_replicas.values()),
                                                  pending_request=pr)
        return pr, ranks

    def route(self, req: SimRequest, now: float) -> int:
        self.now = now
        md = self._RequestMetadata(request_id=req.req_id, internal_request_id=req.req_id)
        pr, ranks = self.loop.run_until_complete(self._choose(_Prompt(self.text.render(req.prompt_token_ids)), md))
        q = self.cluster.ongoing
        low = min(q[r.index] for r in ranks[0])
        chosen = self.rng.choice([r for r in ranks[0] if q[r.index] == low])
        self.router.on_request_routed(pr, chosen.replica_id, None)
        self.router.on_new_queue_len_info(chosen.replica_id, q[chosen.index] + 1)
        return chosen.index

    def on_finished(self, req_id: str, replica: int, now: float) -> None:
        self.now = now
        r = self.replicas[replica]
        self.router.on_new_queue_len_info(r.replica_id, self.cluster.ongoing[replica])


@dataclass(slots=True)
class _Prompt:
    prompt: str


class _TreeShim:
    """Stands in for the PrefixTreeActor handle: `tree_actor.method.remote(*a)` calls the local tree."""

    def __init__(self, tree):
        self._tree = tree

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self._tree, name))


class _FakeReplica:
    """The RunningReplica surface the router reads."""

    def __init__(self, replica_id, index: int, cluster: ClusterView):
        self.replica_id = replica_id
        self.index = index
        self._cluster = cluster
        self.max_ongoing_requests = 1 << 30
        self.node_id = "node0"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict = {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._cluster.ongoing[self.index]


def pull_kv_events(replica: int, feed: SimReplica, ids: list[str], next_seq: list[int | None],
                   epoch: list[str | None], needs_snapshot, apply_events, apply_snapshot) -> None:
    """One periodic pull of a replica's KV events, as the real shell's feed does it (app/routing/feed.py): a
    snapshot when the index asks for one (new, gapped, restarted replica) or the log lost the range, else
    the events since the last pull. `next_seq`/`epoch` (per replica) are updated in place; the index is
    reached through `needs_snapshot()` -> replica ids, `apply_events(KVEventBatch)` -> bool (False: gap)
    and `apply_snapshot(KVSnapshot)`."""
    from affinity_serve.app.routing import KVEventBatch, KVSnapshot
    rid = ids[replica]

    def resync() -> None:
        snap = feed.kv_snapshot()      # a replica with a KV connector also reports its tier's hashes
        apply_snapshot(KVSnapshot(rid, snap.epoch, snap.next_seq, snap.block_hashes, dict(snap.tier_block_hashes)))
        next_seq[replica], epoch[replica] = snap.next_seq, snap.epoch

    if next_seq[replica] is None or rid in needs_snapshot():
        resync()
        return
    reply = feed.kv_events_since(next_seq[replica], epoch[replica])
    if reply.snapshot_required:
        resync()
        return
    next_seq[replica] = reply.next_seq
    if not apply_events(KVEventBatch(rid, reply.epoch, reply.first_seq, reply.events)):
        resync()

