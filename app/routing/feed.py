"""KVEventFeed: keeps a router core's prefix index fed from every replica's KV event log, off the request path.

Every `period_s` the feed starts, for each replica without a pull still in flight, one call: the events
after the replica's cursor (`kv_events_since(next_seq, epoch)`), or a whole `kv_snapshot()` when the core
says the replica's entries are not trustworthy (new, gapped, restarted, reset) or the replica asked for one.
Each call has its own `timeout_s`; a replica that does not answer is skipped until the next period and
never delays the others. Everything runs as tasks on the caller's event loop (the router loop), so the
core is only ever touched from that loop. No Ray here: the shell supplies a `ReplicaFeedClient` per
replica (tests supply fakes).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from affinity_serve.app.routing.api import KVEventBatch, KVSnapshot, RouterCore
from affinity_serve.engine.types import KVCacheSnapshot, KVEventsReply

#: Serve request ids of the feed's calls start with this (app/replica.py drops their access-log lines).
KV_FEED_REQUEST_ID_PREFIX = "kv-feed-"

logger = logging.getLogger(__name__)


class ReplicaFeedClient(Protocol):
    """How the feed reaches one replica's KV event log (LLMReplica.kv_events_since / kv_snapshot)."""

    async def events_since(self, next_seq: int, epoch: str | None) -> KVEventsReply: ...

    async def snapshot(self) -> KVCacheSnapshot: ...


@dataclass(slots=True)
class _Cursor:
    epoch: str | None = None
    next_seq: int = 0
    wants_snapshot: bool = True
    timeouts_in_a_row: int = 0
    answered_at: float = 0.0        # the feed's clock: the last answered pull (the first ask, until one is)


#: pulls of one replica timing out in a row before a warning (at the default 0.25 s period: ~5 s)
WARN_AFTER_TIMEOUTS = 20


@dataclass(slots=True)
class FeedCounters:
    num_pulls: int = 0
    num_events: int = 0
    num_snapshots: int = 0
    num_timeouts: int = 0
    num_errors: int = 0
    num_pauses: int = 0


class KVEventFeed:
    """Pulls KV events into `core` for the replicas `replicas()` names (replica id -> client) now.
    `clock` (seconds, monotonic) times each replica's lag (`health`)."""

    def __init__(self, core: RouterCore, replicas: Callable[[], Mapping[str, ReplicaFeedClient] | None],
                 period_s: float, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 idle_s: float = 0.0, last_active: Callable[[], float] | None = None) -> None:
        """`idle_s` > 0 with `last_active` (when its owner last routed, on `clock`): after `idle_s` without
        routing the feed pauses (see `pause`) until the owner routes again."""
        self.core = core
        self.replicas = replicas
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.idle_s = idle_s
        self.last_active = last_active
        self.paused = False
        self.counters = FeedCounters()
        self._cursors: dict[str, _Cursor] = {}
        self._in_flight: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        """Tick until `replicas()` answers None (its owner is gone) or the task is cancelled; a failing tick
        is logged and the next one runs. Paused while its owner is idle."""
        while True:
            try:
                if self.is_idle():
                    self.pause()
                else:
                    self.paused = False
                    if self.tick() is None:
                        self.stop()
                        return
            except Exception:
                logger.exception("KV event feed tick failed")
            await asyncio.sleep(self.period_s)

    def is_idle(self) -> bool:
        return (self.idle_s > 0 and self.last_active is not None
                and self.clock() - self.last_active() >= self.idle_s)

    def pause(self) -> None:
        """Stop pulling and drop the index: an index nobody keeps current would route on stale holdings, and
        it is the router's memory (hundreds of MB at fleet scale). Serve keeps the router of a dropped handle
        for the process's life, so this is what bounds one: a shell that pulls nothing. The next tick after
        the owner routes again takes snapshots (every replica then needs one)."""
        if self.paused:
            return
        self.paused = True
        self.counters.num_pauses += 1
        self.stop()
        self._cursors.clear()
        self.core.forget_kv_state()
        logger.debug("KV event feed paused: no routing for %.0fs (routing.kv_events_idle_s)", self.idle_s)

    def tick(self) -> list[asyncio.Task] | None:
        """Start one pull per replica that has none in flight; returns the tasks started (tests await them),
        None when `replicas()` answers None (the owner is gone: nothing to pull for)."""
        clients = self.replicas()
        if clients is None:
            return None
        for rid in [r for r in self._cursors if r not in clients]:
            del self._cursors[rid]
        needing = set(self.core.replicas_needing_snapshot())
        started = []
        for rid, client in clients.items():
            task = self._in_flight.get(rid)
            if task is not None and not task.done():
                continue
            cursor = self._cursors.get(rid)
            if cursor is None:
                cursor = self._cursors[rid] = _Cursor(answered_at=self.clock())
            snapshot = cursor.wants_snapshot or rid in needing
            task = asyncio.get_running_loop().create_task(self._pull(rid, client, cursor, snapshot))
            self._in_flight[rid] = task
            started.append(task)
        return started

    async def _pull(self, rid: str, client: ReplicaFeedClient, cursor: _Cursor, snapshot: bool) -> None:
        try:
            if snapshot:
                snap = await asyncio.wait_for(client.snapshot(), self.timeout_s)
                self._apply_snapshot(rid, cursor, snap)
            else:
                reply = await asyncio.wait_for(client.events_since(cursor.next_seq, cursor.epoch), self.timeout_s)
                self._apply_events(rid, cursor, reply)
            if cursor.timeouts_in_a_row >= WARN_AFTER_TIMEOUTS:
                logger.info("replica %s answers KV event pulls again", rid)
            cursor.timeouts_in_a_row = 0
            cursor.answered_at = self.clock()
        except TimeoutError:
            self.counters.num_timeouts += 1
            cursor.timeouts_in_a_row += 1
            if cursor.timeouts_in_a_row == WARN_AFTER_TIMEOUTS:        # once per streak
                logger.warning("replica %s has not answered %d KV event pulls in a row within %.2fs "
                               "(routing.kv_events_timeout_s): the router does not see what it caches, so its "
                               "prefix hits are missed until it answers", rid, WARN_AFTER_TIMEOUTS, self.timeout_s)
            else:
                logger.debug("replica %s did not answer the KV event pull within %.2fs", rid, self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:        # a dying replica, a bad reply: skip it this period
            self.counters.num_errors += 1
            logger.warning("KV event pull from replica %s failed: %r", rid, e)
        finally:
            self.counters.num_pulls += 1

    def _apply_snapshot(self, rid: str, cursor: _Cursor, snap: KVCacheSnapshot) -> None:
        if self._cursors.get(rid) is not cursor:
            return                           # the replica left while we waited
        tiers = {medium: list(hashes) for medium, hashes in (snap.tier_block_hashes or {}).items()}
        self.core.on_snapshot(KVSnapshot(rid, snap.epoch, snap.next_seq, list(snap.block_hashes), tiers))
        cursor.epoch, cursor.next_seq, cursor.wants_snapshot = snap.epoch, snap.next_seq, False
        self.counters.num_snapshots += 1

    def _apply_events(self, rid: str, cursor: _Cursor, reply: KVEventsReply) -> None:
        if self._cursors.get(rid) is not cursor:
            return
        if reply.snapshot_required:
            cursor.wants_snapshot = True
            return
        if reply.events:
            ok = self.core.on_kv_events(KVEventBatch(rid, reply.epoch, reply.first_seq, list(reply.events)))
            self.counters.num_events += len(reply.events)
            if not ok:
                cursor.wants_snapshot = True
                return
        cursor.epoch, cursor.next_seq = reply.epoch, reply.next_seq

    def cursors(self) -> dict[str, tuple[str | None, int]]:
        """Replica id -> (epoch, next event number) as the feed last saw them."""
        return {rid: (c.epoch, c.next_seq) for rid, c in self._cursors.items()}

    def health(self) -> dict[str, tuple[int, float]]:
        """Replica id -> (pulls timed out in a row now, seconds since its last answered pull, or since the
        feed first asked it if it never answered)."""
        now = self.clock()
        return {rid: (c.timeouts_in_a_row, max(0.0, now - c.answered_at)) for rid, c in self._cursors.items()}

    def stop(self) -> None:
        for task in self._in_flight.values():
            task.cancel()
        self._in_flight.clear()
