"""One metrics view per app, whichever ingress replica answers `/metrics`.

Each process of the app (every ingress replica and every model replica) runs a `MetricsExporter`: a daemon
thread that collects the process's meter every `PUSH_INTERVAL_S` (so a replica's gauges are read while its
requests run, not only when one finishes) and pushes the snapshot to the app's `MetricsHub`, a detached
Ray actor named after the app. Only the app's own processes create the hub, as they start; Serve's controller
(the autoscaling policy's decisions) only looks it up. An ingress answering `/metrics` pushes its own fresh
snapshot and gets back the Prometheus text of the merge (observability/aggregate.py): counters summed over
processes, so they only grow across scrapes however the proxy spreads them over ingress replicas.

Outside Serve (unit tests, a bare `Ingress`), nothing is pushed and `/metrics` shows this process only. Inside
an app, `/metrics` never falls back to one process's numbers: while the hub cannot be reached it is a 503 (a
failed scrape), since one process's counters, below the app's totals, would read to Prometheus as a reset of
every counter, twice (down, then up when the hub answers again), and `rate()` over it would spike.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.observability.aggregate import MetricsAggregate, Snapshot, render, snapshot_of

logger = logging.getLogger("affinity.metrics")

HUB_NAMESPACE = "affinity-serve"
PUSH_INTERVAL_S = 1.0
#: a process's gauges vanish this long after its last push (a replica that stopped has no load), or after
#: aggregate.GAUGE_TTL_PUSHES of its push intervals if longer
GAUGE_TTL_S = 5.0
#: after this long without a push a process's counters join the retired totals (observability/aggregate.py)
RETIRE_AFTER_S = 300.0
#: a scrape waits this long for the hub's merge, then fails (503) rather than hang past Prometheus's timeout
RENDER_TIMEOUT_S = 8.0
#: a hub (new, re-created, restarted) renders nothing this long after it starts, or for 3 of the longest push
#: interval it has been told of: until every process has pushed, its merge would be one process's counts read
#: as the app's (a scrape then fails instead)
HUB_WARMUP_S = 3 * PUSH_INTERVAL_S


class MetricsHub:
    """The Ray actor's body: the latest snapshot of every process of one app (see MetricsAggregate)."""

    def __init__(self, gauge_ttl_s: float = GAUGE_TTL_S, retire_after_s: float = RETIRE_AFTER_S,
                 warmup_s: float = HUB_WARMUP_S):
        self.aggregate = MetricsAggregate(gauge_ttl_s, retire_after_s)
        self.started_at = time.monotonic()
        self.warmup_s = warmup_s
        self.longest_interval_s = 0.0           # the longest push interval a process declared

    def push(self, process: str, snapshot: Snapshot, interval_s: float | None = None) -> int:
        """A process's snapshot; `interval_s`: how often it pushes (its gauges last GAUGE_TTL_PUSHES of them)."""
        self.aggregate.push(process, snapshot, time.monotonic(), interval_s)
        self.longest_interval_s = max(self.longest_interval_s, interval_s or 0.0)
        return self.aggregate.num_processes

    def render(self, process: str, snapshot: Snapshot, model_name: str | None, vllm_aliases: bool = True,
               interval_s: float | None = None) -> str | None:
        """Push the caller's own snapshot, then the Prometheus text of every process's; None in the hub's first
        `warmup_s` (not every process has pushed yet) and while there is nothing to show (an app starting: its
        model replicas still loading, nothing pushed a sample yet; an empty 200 would read as no series)."""
        now = time.monotonic()
        self.aggregate.push(process, snapshot, now, interval_s)
        self.longest_interval_s = max(self.longest_interval_s, interval_s or 0.0)
        if self.warmup_s > 0 and now - self.started_at < max(self.warmup_s, 3 * self.longest_interval_s):
            return None
        text = render(self.aggregate.merged(now), model_name, vllm_aliases)
        return text if text.strip() else None


def hub_name(app_name: str) -> str:
    return f"metrics:{app_name}"


def get_hub(app_name: str) -> Any:
    """The app's hub actor, created if missing: only for a process of the app as it starts (MetricsExporter's
    first connection). Detached: it outlives the process that made it, so the totals survive any one replica
    (it goes when Ray does; `ray.kill` it after deleting the app to free it sooner)."""
    return _hub_actor_class().options(name=hub_name(app_name), namespace=HUB_NAMESPACE, lifetime="detached",
                         get_if_exists=True).remote()


def find_hub(app_name: str) -> Any | None:
    """The app's hub actor if it exists, else None; never creates it, so a push for an app that is gone (Serve's
    controller still calling a deleted deployment's policy, a replica of it shutting down) cannot bring back a
    hub killed after the app was deleted."""
    import ray
    try:
        return ray.get_actor(hub_name(app_name), namespace=HUB_NAMESPACE)
    except ValueError:             # no actor of that name (Ray's answer for a missing named actor)
        return None


@functools.cache
def _hub_actor_class() -> Any:
    import ray
    return ray.remote(num_cpus=0, max_restarts=-1)(MetricsHub)


def _is_signature_error(e: BaseException) -> bool:
    """Whether a call to the hub failed on its arguments (a hub actor of an earlier version: the hub is detached
    and outlives redeploys, so it may predate the interval argument)."""
    return isinstance(e, TypeError) or "TypeError" in type(e).__name__ or "positional argument" in str(e)


class MetricsUnavailable(Exception):
    """The app's merged metrics cannot be had now: its hub is unreachable (restarting, killed, Ray busy)."""


def serve_app_and_replica() -> tuple[str, str] | None:
    """(app name, replica id) inside a Serve replica, None elsewhere."""
    try:
        from ray import serve
        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.replica_id.unique_id
    except Exception:
        return None


class MetricsExporter:
    """This process's side: pushes its snapshot to the app's hub on a timer, and renders `/metrics`."""

    def __init__(self, reader: InMemoryMetricReader, app_name: str | None, process: str,
                 interval_s: float = PUSH_INTERVAL_S, active: Callable[[], bool] | None = None,
                 creates_hub: bool = True):
        """`active`, if given, is asked before each timed push: while it says False nothing is pushed, so the
        hub lets this process's gauges go after GAUGE_TTL_S and retires its counters after RETIRE_AFTER_S (a
        source that outlives what it measures, such as the autoscaling policy's of a deleted deployment).
        `creates_hub`: a process of the app, whose first connection creates the hub if it is missing (any later
        one, after the hub was killed, only looks it up); False for a pusher from outside the app (Serve's
        controller), which only ever looks it up and pushes nothing while there is none."""
        self.reader = reader
        self.active = active
        self._may_create_hub = creates_hub
        self._creates_hub = creates_hub
        self.app_name = app_name
        self.process = f"{process}:{uuid.uuid4().hex[:8]}"      # a restarted process is a new one
        self.interval_s = interval_s
        self._hub: Any = None
        self._hub_takes_interval = True         # False for a hub of an earlier version (no interval argument)
        self._hub_lock = threading.Lock()
        self._stop = threading.Event()
        self._warned = False
        self._warn_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if app_name is not None:
            self._thread = threading.Thread(target=self._loop, name="metrics-push", daemon=True)
            self._thread.start()

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.reader.get_metrics_data())

    def push_once(self) -> None:
        """Collect and push now (blocking; the timer thread's step); nothing while the app has no hub."""
        import ray
        hub = self._hub_handle()
        if hub is None:
            return
        timeout = max(10.0, 5 * self.interval_s)
        if self._hub_takes_interval:
            try:
                ray.get(hub.push.remote(self.process, self.snapshot(), self.interval_s), timeout=timeout)
                self._answered()
                return
            except Exception as e:
                if not _is_signature_error(e):
                    raise
                self._hub_takes_interval = False       # a hub of an earlier version (it outlives redeploys)
        ray.get(hub.push.remote(self.process, self.snapshot()), timeout=timeout)
        self._answered()

    async def render(self, model_name: str | None, vllm_aliases: bool = True) -> str:
        """The app's merged metrics as Prometheus text (this process's alone outside an app). Raises
        MetricsUnavailable when the hub cannot be asked: never this process's numbers in place of the app's
        (they would read as a reset of every counter). A process of the app (`creates_hub`) makes the hub again
        if it was killed: it is answering a scrape, so the app is live (each process pushes its cumulative
        counts, so the totals come back, less those of processes that stopped before; the new hub renders
        nothing until every process has had time to push)."""
        snap = self.snapshot()
        if self.app_name is None:
            return render(snap, model_name, vllm_aliases)
        try:
            # the lookup (or creation) is a blocking call to Ray: off the ingress's loop, within the bound
            hub = await asyncio.wait_for(asyncio.to_thread(self._hub_handle, self._creates_hub), RENDER_TIMEOUT_S)
            if hub is None:
                raise MetricsUnavailable(f"the metrics hub of app {self.app_name!r} does not exist (yet)")
            text = None
            if self._hub_takes_interval:
                try:
                    text = await asyncio.wait_for(hub.render.remote(self.process, snap, model_name, vllm_aliases,
                                                                    self.interval_s), RENDER_TIMEOUT_S)
                except Exception as e:
                    if not _is_signature_error(e):
                        raise
                    self._hub_takes_interval = False
            if not self._hub_takes_interval:
                text = await asyncio.wait_for(hub.render.remote(self.process, snap, model_name, vllm_aliases),
                                              RENDER_TIMEOUT_S)
            if text is None:
                raise MetricsUnavailable(f"the metrics hub of app {self.app_name!r} has just started or has nothing "
                                         "to show yet: not every process has pushed to it (3 push intervals, and "
                                         "until one has pushed a sample)")
            self._answered()
            return text
        except MetricsUnavailable:
            raise
        except Exception as e:
            # off the loop: _hub_lock may be held by the push thread's blocking hub lookup
            await asyncio.to_thread(self._forget_hub, e)
            raise MetricsUnavailable(f"the metrics hub of app {self.app_name!r} is unreachable "
                                     f"({type(e).__name__})") from e

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.active is None or self.active():
                    self.push_once()
            except Exception as e:         # the hub restarting, Ray shutting down: try again next tick
                self._forget_hub(e)

    def _hub_handle(self, create: bool = False) -> Any | None:
        """The hub, None while it does not exist; created here at this process's first connection, if it may
        (`creates_hub`), or when `create` (a scrape answered by a process of the app)."""
        with self._hub_lock:
            if self._hub is None:
                assert self.app_name is not None
                if self._may_create_hub or create:
                    self._hub = get_hub(self.app_name)
                    self._may_create_hub = False
                else:
                    self._hub = find_hub(self.app_name)
            return self._hub

    def _forget_hub(self, e: Exception) -> None:
        with self._hub_lock:
            self._hub = None
            self._hub_takes_interval = True
        with self._warn_lock:                   # once per outage, whichever thread is first
            first, self._warned = not self._warned, True
        if first:
            logger.warning("metrics hub of app %s unreachable (%s: %s); retrying every %.1fs", self.app_name,
                           type(e).__name__, e, self.interval_s)

    def _answered(self) -> None:
        """The hub took a push or answered a scrape: an outage warned about is over (said once)."""
        with self._warn_lock:       # not _hub_lock: held across a blocking hub lookup, and this runs on a loop
            back, self._warned = self._warned, False
        if back:
            logger.info("metrics hub of app %s answers again", self.app_name)
