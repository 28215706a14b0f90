"""AffinityRequestRouter: the thin Ray Serve shell over the pure routing core (app/routing/core.py).

It only adapts Serve's callbacks: membership and `routing_stats` -> core.set_replicas/on_stats; a pending
request's GenerateRequest -> RouteRequest -> core.route -> ranks; routed/completed/died -> the core's
lifecycle calls; and it runs the KV event feed (app/routing/feed.py) as a task on the router loop, and
another that leaves a plain sample of its counters for the process's /metrics (app/routing/debug.py).

Serve runs one router per (process, handle) on its router loop thread and pickles this module by value:
other modules it imports are imported by reference where the router runs (the ingress replica, a driver).
`choose_replicas` never raises (in Ray 2.60 an exception there hangs the request): on any error it logs
and returns a load-only ranking.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ray.serve.request_router import (LocalityMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter,
                                      RunningReplica)

from affinity_serve.app.config import RoutingSection
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.app.routing import debug
from affinity_serve.app.routing.api import (CandidateScores, Decision, Reason, ReplicaInfo, ReplicaLoadView,
                             RouteRequest)
from affinity_serve.app.routing.config import KV_EVENT_POLICIES
from affinity_serve.app.routing.core import make_core
from affinity_serve.app.routing.feed import FeedCounters, KVEventFeed, ReplicaFeedClient
from affinity_serve.app.routing.serve_compat import ReplicaMethodClient, internal_request_id, pending_args
from affinity_serve.observability.metrics import FeedReplicaSample, IndexSample, RouterSample

logger = logging.getLogger("affinity.router")

_MAX_TRACKED_CALLS = 100_000       # (internal id, replica) -> our ids whose completion never came: bounded
#: how often a router leaves a fresh metrics sample (the process's pushes read the latest)
METRICS_SAMPLE_PERIOD_S = 0.5


def _replica_key(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


def _generate_request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The ingress's GenerateRequest, if this call carries one (pre-warm calls, drivers: None)."""
    args = pending_args(pending_request)
    return args[0] if args and isinstance(args[0], GenerateRequest) else None


class AffinityRequestRouter(LocalityMixin, RequestRouter):
    """Serve's RequestRouter for LLMReplica; kwargs (RequestRouterConfig.request_router_kwargs, built by
    builder.router_kwargs): the app's `routing` section as JSON and the engine's KV block size."""

    method_client: Callable[[RunningReplica], ReplicaMethodClient] = ReplicaMethodClient   # tests swap it

    def initialize_state(self, routing: dict[str, Any], block_size: int, warmup_timeout_s: float = 30.0) -> None:
        """`routing`: the `routing` section (RoutingSection) as JSON, the one place it crosses as a dict:
        Serve takes a router's kwargs as JSON only; validated back here, so its defaults are the config's."""
        r = RoutingSection.model_validate(routing)
        self.policy = r.policy
        self.warmup_num_prefixes = r.warmup_num_prefixes if r.warmup_on_join else 0
        self.warmup_timeout_s = warmup_timeout_s
        self._warm_tasks: set[asyncio.Task] = set()
        self.num_warmups = 0
        self.core = make_core(r.policy, r.affinity, block_size)
        self._clients: dict[str, ReplicaMethodClient] = {}
        self._last_stats: dict[str, Mapping[str, Any]] = {}
        self._calls: dict[tuple[str, str], list[str]] = {}
        self._rng = random.Random()
        self.num_shell_errors = 0
        self._inject_errors = 0
        # The feed and the metrics sampling run as tasks on the router loop for the router's life: they hold
        # it weakly, so a router whose handle is dropped is collected and they end (Serve never stops them:
        # a strong reference kept every dropped handle's router pulling every replica's events for the
        # process's life). A weak reference to the router, never to a bound method: Serve unpickles this
        # class by value again at each deployment config update, and cloudpickle then sets the new function
        # objects on the existing class, so the method's old function dies while the router lives.
        me = weakref.ref(self)
        #: when this router last routed or predicted (time.monotonic): after routing.kv_events_idle_s without,
        #: the feed pauses and drops the index (Serve itself keeps a dropped handle's router alive)
        self.last_active = time.monotonic()
        #: when it last routed (choose_replicas), for the ingress's admission to ask the router in use
        self.last_routed = 0.0
        self.feed = (KVEventFeed(self.core, lambda: _clients_if_alive(me), r.kv_events_period_s,
                                 r.kv_events_timeout_s, idle_s=r.kv_events_idle_s,
                                 last_active=lambda: _last_active_if_alive(me))
                     if r.policy in KV_EVENT_POLICIES else None)
        self._feed_task: asyncio.Task | None = None
        #: the latest sample for /metrics, replaced on the router loop, read by the metrics thread
        self.metrics_sample: RouterSample | None = None
        self._metrics_task: asyncio.Task | None = None
        self._exports_metrics = debug.register(self._deployment_id.app_name, self._deployment_id.name, self)

    # ------------------------------------------------------------ membership and stats
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:
            self._sync_members(replicas)
            if self.feed is not None and self._feed_task is None:
                self._feed_task = self._event_loop.create_task(self.feed.run())
            if self._exports_metrics and self._metrics_task is None:
                self._metrics_task = self._event_loop.create_task(_sample_metrics(weakref.ref(self)))
        except Exception:
            logger.exception("routing: replica update failed (routing continues on the previous view)")

    def _sync_members(self, replicas: list[RunningReplica]) -> None:
        keys = {_replica_key(r.replica_id): r for r in replicas}
        # A replica that joins a set this router already routed over (scale-out, a replacement) starts
        # cold: warm it off the request path. The first view is the deployment as it was, not a join.
        joined = [k for k in keys if k not in self._clients] if self._clients else []
        self._clients = {k: self._clients.get(k) or self.method_client(r) for k, r in keys.items()}
        self.core.set_replicas([ReplicaInfo(k, r.node_id) for k, r in keys.items()])
        self._last_stats = {k: v for k, v in self._last_stats.items() if k in keys}
        for k, r in keys.items():
            stats = r.routing_stats
            # Serve rebroadcasts every replica's stats when one changes: only a changed snapshot is news
            # (feeding an old one again would retire this router's in-flight requests a second time).
            if stats and stats != self._last_stats.get(k):
                self._last_stats[k] = dict(stats)
                self.core.on_stats(k, ReplicaLoadView.from_stats(stats))
        for k in joined:
            self._start_warmup(k)

    def _start_warmup(self, key: str) -> None:
        """Prefill the joining replica with the hottest prefixes this router knows (their BlockStored
        events then show it holding them, so affinity and hot-group spreading can use it)."""
        hot_prefixes = getattr(self.core, "hot_prefixes", None)
        if not self.warmup_num_prefixes or hot_prefixes is None or (self.feed is not None and self.feed.paused):
            return                                   # paused: idle, its hot prefixes are gone (forget_kv_state)
        prompts = hot_prefixes(self.warmup_num_prefixes)
        if not prompts:
            return
        task = self._event_loop.create_task(self._warm(key, self._clients[key], prompts))
        self._warm_tasks.add(task)
        task.add_done_callback(self._warm_tasks.discard)

    async def _warm(self, key: str, client: ReplicaMethodClient, prompts: list[list[int]]) -> None:
        try:
            out = await asyncio.wait_for(client.warm(prompts), self.warmup_timeout_s)
            self.num_warmups += 1
            logger.info("routing: warmed joining replica %s with %d hot prefixes (%s)", key, len(prompts), out)
        except asyncio.CancelledError:
            raise
        except Exception as e:         # a replica that left or failed: routing goes on without the warm-up
            logger.warning("routing: warming joining replica %s failed: %r", key, e)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        try:
            self._sync_members(list(self.curr_replicas.values()))
        except Exception:
            logger.exception("routing: dropping replica %s failed", replica_id)

    def num_replicas(self) -> int:
        """Replicas this router can send to now (Serve drops a stopping replica at once); any thread."""
        return len(self._replicas)

    def predicted_wait_s(self, req_id: str, prompt_token_ids: list[int], block_hashes: list | None,
                         max_tokens: int, bound: float | None = None) -> float | None:
        """The best predicted TTFT over this router's replicas for such a request, recording nothing (run it
        on the router loop: `run_on_loop`); None when the policy predicts none (load-only policies). With
        `bound`, a wait within it may be an upper bound of the best (core.predict_wait)."""
        predict = getattr(self.core, "predict_wait", None)
        if predict is None:
            return None
        self.last_active = time.monotonic()
        route = RouteRequest(req_id, list(block_hashes or []), len(prompt_token_ids), max_tokens,
                             self._self_node_id)
        return predict(route, list(self._clients), bound)

    # ------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self.last_active = self.last_routed = time.monotonic()
        try:
            return self._rank(candidate_replicas, pending_request)
        except Exception:
            self.num_shell_errors += 1
            logger.exception("routing failed; falling back to a load-only ranking")
            ranks = self._load_only(candidate_replicas)
            self._post_fallback(pending_request, ranks)
            return ranks

    def _rank(self, candidates: list[RunningReplica],
              pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        if self._inject_errors > 0:
            self._inject_errors -= 1
            raise RuntimeError("injected routing error (debug_inject_routing_errors)")
        req = _generate_request(pending_request)
        if req is not None:
            req.cached_on = None                       # a re-route must not keep an earlier prediction
            req.routing.value = None
        if req is None or not candidates:
            return self._load_only(candidates)
        by_key = {_replica_key(r.replica_id): r for r in candidates}
        params = req.sampling_params
        route = RouteRequest(req.req_id, list(req.block_hashes or []), len(req.prompt_token_ids),
                             (params.max_tokens or 0) * max(1, params.n), self._self_node_id)
        decision = self.core.route(route, list(by_key))
        # Serve pickles the request's args when it sends them to the chosen replica, after this returns: the
        # prediction travels on; the decision stays on the ingress's own object for its span and metrics.
        req.routing.value = decision
        req.cached_on = decision.most_cached(2)
        ranked = [by_key[k] for k in decision.ranked if k in by_key]
        if not ranked:
            return self._load_only(candidates)
        # One replica per rank, best first: the core already broke near-ties randomly, and Serve walks down
        # the ranks when a replica is full. Candidates the core left out come last.
        seen = {id(r) for r in ranked}
        rest = [r for r in candidates if id(r) not in seen]
        return [[r] for r in ranked] + ([rest] if rest else [])

    @staticmethod
    def _post_fallback(pending_request: PendingRequest | None, ranks: list[list[RunningReplica]]) -> None:
        """A FALLBACK decision for the ingress, so a shell error shows on the request's span and metrics."""
        try:
            req = _generate_request(pending_request)
            if req is not None:
                req.cached_on = None
            ids = [_replica_key(r.replica_id) for rank in ranks for r in rank]
            if req is not None and ids:
                req.routing.value = Decision(req.req_id, ids, ids[0], Reason.FALLBACK, CandidateScores.empty(),
                                             0.0)
        except Exception:
            logger.exception("routing: recording the fallback decision failed")

    def _load_only(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Serve's power-of-two shape: two random candidates (Serve takes the shorter queue, the first of
        equals: hence shuffled), then the rest."""
        if len(candidates) <= 2:
            return [self._rng.sample(candidates, len(candidates))] if candidates else []
        pair = self._rng.sample(candidates, 2)
        return [pair, [r for r in candidates if r is not pair[0] and r is not pair[1]]]

    # ------------------------------------------------------------ request lifecycle
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        try:
            req = _generate_request(pending_request)
            if req is None:
                return
            key = _replica_key(replica_id)
            self.core.on_routed(req.req_id, key)
            if len(self._calls) >= _MAX_TRACKED_CALLS:
                self._calls.pop(next(iter(self._calls)))
            self._calls.setdefault((internal_request_id(pending_request), key), []).append(req.req_id)
        except Exception:
            logger.exception("routing: on_request_routed failed")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        try:
            call = (internal_request_id, _replica_key(replica_id))
            ids = self._calls.get(call)
            if not ids:
                return
            # Each call has its own Serve internal id (app.fanout.own_serve_call); a list still, so calls
            # made elsewhere under one shared id each finish one of theirs.
            self.core.on_finished(ids.pop(0))
            if not ids:
                del self._calls[call]
        except Exception:
            logger.exception("routing: on_request_completed failed")

    def on_first_token(self, req_id: str, num_cached_tokens: int, kv_wait_s: float = 0.0) -> None:
        """The ingress saw the request's first token (run on the router loop via call_soon), which waited
        `kv_wait_s` in its engine's queue for KV blocks."""
        try:
            self.core.on_first_token(req_id, num_cached_tokens, kv_wait_s)
        except Exception:
            logger.exception("routing: on_first_token failed")

    # ------------------------------------------------------------ called from other threads (the ingress)
    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the router loop (the core is not thread-safe)."""
        self._event_loop.call_soon_threadsafe(fn, *args)

    async def run_on_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` run on the router loop, awaited from any loop."""
        async def call() -> Any:
            return fn(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self._event_loop))

    def build_metrics_sample(self) -> RouterSample:
        """This router's counters, index sizes and feed health as plain values (run on the router loop: the
        core is not thread-safe)."""
        c = self.core.counters()
        index = getattr(self.core, "index", None)
        indexes = {}
        if index is not None:          # prefix_affinity, llm_d_precise: app/routing/prefix_index.py
            indexes = {"pool": IndexSample(index.num_entries, index.bound, index.num_evictions),
                       "tier": IndexSample(index.num_tier_entries, index.max_tier_blocks, index.num_tier_evictions)}
        f = self.feed.counters if self.feed is not None else FeedCounters()
        health = self.feed.health() if self.feed is not None else {}
        return RouterSample(
            self._deployment_id.name, num_pulls_ok=f.num_pulls - f.num_timeouts - f.num_errors,
            num_pulls_timed_out=f.num_timeouts, num_pulls_error=f.num_errors, num_events=f.num_events,
            num_snapshots=f.num_snapshots, num_resyncs=c.num_resyncs, num_core_errors=c.num_errors,
            num_shell_errors=self.num_shell_errors, num_rerouted=c.num_rerouted, index=indexes,
            feed={rid: FeedReplicaSample(n, lag) for rid, (n, lag) in health.items()},
            feed_paused=self.feed.paused if self.feed is not None else None)

    def inject_errors(self, n: int) -> None:
        """Test hook: the next `n` choose_replicas calls fail inside the shell (and must fall back)."""
        self._inject_errors = n

    def state(self, num_decisions: int) -> dict[str, Any]:
        """Decisions, counters and the index as this router sees them (JSON-able; run on the router loop)."""
        c = self.core.counters()
        index = getattr(self.core, "index", None)
        needing = set(self.core.replicas_needing_snapshot())
        cursors = self.feed.cursors() if self.feed is not None else {}
        return {
            "policy": self.policy, "node_id": self._self_node_id, "num_shell_errors": self.num_shell_errors,
            "num_warmups": self.num_warmups,
            "decisions": [debug.decision_to_dict(d) for d in self.core.recent_decisions(num_decisions)],
            "counters": {"num_decisions": c.num_decisions, "num_errors": c.num_errors,
                         "num_rerouted": c.num_rerouted, "num_resyncs": c.num_resyncs,
                         "num_index_entries": c.num_index_entries, "num_index_evictions": c.num_index_evictions,
                         # null where no index predicts (load-only policies) or nothing was predicted yet
                         "index_accuracy": (c.index_accuracy if index is not None
                                            and math.isfinite(c.index_accuracy) else None),
                         "num_accuracy_samples": c.num_accuracy_samples,
                         "prefill_tokens_per_s": c.prefill_tokens_per_s,
                         "by_reason": {r.value: n for r, n in c.num_by_reason.items()}},
            "feed": None if self.feed is None else vars_of(self.feed.counters),
            "replicas": {k: {"num_held_blocks": index.num_held(k) if index is not None else None,
                             "needs_snapshot": k in needing, "epoch": cursors.get(k, (None, 0))[0],
                             "next_seq": cursors.get(k, (None, 0))[1]} for k in self._clients},
        }


def vars_of(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__slots__}


def _clients_if_alive(ref: weakref.ref) -> Mapping[str, ReplicaFeedClient] | None:
    """The weakly held router's replica clients (the feed's replicas); None once the router is gone."""
    router = ref()
    return router._clients if router is not None else None


def _last_active_if_alive(ref: weakref.ref) -> float:
    """When the weakly held router last routed; +inf once it is gone (never idle: the feed's next tick finds
    no owner and ends)."""
    router = ref()
    return router.last_active if router is not None else math.inf


async def _sample_metrics(ref: weakref.ref) -> None:
    """Leave a fresh `metrics_sample` on the router every METRICS_SAMPLE_PERIOD_S, until it is collected (or
    the task is cancelled); holds it only while sampling."""
    warned = False
    while True:
        router = ref()
        if router is None:
            return
        try:
            router.metrics_sample = router.build_metrics_sample()
        except Exception:
            if not warned:
                warned = True
                logger.exception("routing: sampling the router's metrics failed (retrying quietly)")
        del router
        await asyncio.sleep(METRICS_SAMPLE_PERIOD_S)
