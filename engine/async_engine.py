"""AsyncLLMEngine: a background step loop feeding per-request async streams, with abort and health.

Adds and aborts are queued and applied by the loop between steps; each step runs in a worker thread so
the event loop (HTTP, Ray Serve) stays responsive while the model computes. Callers read the engine only
through `limits`, `load()`, `health()` and the KV event feed (`kv_events_since`, `kv_snapshot`): immutable
values, snapshots and events the loop takes between steps, so nobody reads scheduler structures while the
step thread mutates them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import DuplicateRequestError, EngineDeadError, EngineError
from affinity_serve.engine.kv_connector.base import KVConnectorStats
from affinity_serve.engine.kv_events import KVEventLog
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.llm_engine import LLMEngine, Prompt, StepError
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.types import EngineLoad, EngineRequest, KVCacheSnapshot, KVEventsReply, RequestDelta

logger = logging.getLogger(__name__)

_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Whether the step loop is alive, and whether it is making progress."""

    dead_reason: str | None               # None while the engine can serve
    num_unfinished_reqs: int              # sequences the engine holds, as of the last snapshot
    last_progress_time: float             # time.monotonic() of the last step, or of the last idle moment
    num_steps: int

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_seqs: int = 1
    finished: bool = False


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, step_in_thread: bool = True):
        self.engine = engine
        self._step_in_thread = step_in_thread
        self._streams: dict[str, _Stream] = {}
        self._background: set[str] = set()           # request ids of streams generated with background=True
        self._pending_adds: list[tuple[EngineRequest, SamplingParams]] = []   # checked, for the next step
        self._pending_aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        if getattr(engine, "pd", None) is not None:     # a P/D hold read or released: step to free it
            engine.pd.held.on_done = self.wake_threadsafe
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._consecutive_failures = 0
        self.last_progress_time = time.monotonic()
        self._step_lock = asyncio.Lock()        # held while a step runs; reset_prefix_cache waits for it
        self._limits = engine.limits            # fixed once the engine is built
        cache = engine.config.cache
        self._kv_events_enabled = cache.enable_kv_cache_events
        self._kv_events = KVEventLog(engine.cache_epoch, cache.kv_event_buffer_blocks)
        self._load = self.engine.load(self._background)

    @classmethod
    def from_config(cls, config: EngineConfig, **kw: Any) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_config(config), **kw)

    # ------------------------------------------------------------------ public API
    @property
    def limits(self) -> EngineLimits:
        """The request limits (context length after the KV cap, vocabulary, KV slots); immutable."""
        return self._limits

    def load(self) -> EngineLoad:
        """The latest load snapshot (`LLMEngine.load`, taken after every step, add and abort); safe from any
        thread."""
        return self._load

    @property
    def boot_id(self) -> str:
        """Names this engine's life in cache epochs (`LLMEngine.boot_id`)."""
        return self.engine.boot_id

    @property
    def num_steps(self) -> int:
        """Steps the engine has run (`LLMEngine.num_steps`)."""
        return self.engine.num_steps

    def health(self) -> EngineHealth:
        """Liveness and progress; safe from any thread (reads values the loop replaces atomically)."""
        dead_reason = None
        if self._dead is not None:
            dead_reason = f"engine is dead: {self._dead}"
        elif self._loop_task is not None and self._loop_task.done():
            dead_reason = "engine step loop exited"
        return EngineHealth(dead_reason, self._load.num_requests, self.last_progress_time, self.num_steps)

    def kv_connector_stats(self) -> KVConnectorStats | None:
        """A copy of the KV connector's cumulative counters (None without a connector); read while a step
        may run, so the counters can be one step apart from each other."""
        return self.engine.kv_connector_stats()

    @property
    def block_size(self) -> int:
        """Tokens per KV block (`LLMEngine.block_size`)."""
        return self.engine.block_size

    @property
    def pd_block_bytes(self) -> int:
        """`LLMEngine.pd_block_bytes`."""
        return self.engine.pd_block_bytes

    def num_cached_prefix_blocks(self, block_hashes) -> int:
        """`LLMEngine.num_cached_prefix_blocks`; read while a step may run, so it is a hint."""
        return self.engine.num_cached_prefix_blocks(block_hashes)

    def set_kv_transport(self, transport) -> None:
        """`LLMEngine.set_kv_transport`: how the `pd` connector moves KV between engines; call before serving."""
        self.engine.set_kv_transport(transport)

    def pd_counters(self) -> dict | None:
        """P/D (kv_connector.type pd): the connector's cumulative counters (holds and how they ended, the decode
        side's remote requests) as a dict copy; None without it. Unlike `take_pd_transfer_stats`, takes nothing."""
        pd = self.engine.pd
        if pd is None:
            return None
        import dataclasses
        return dataclasses.asdict(pd.pd_stats)

    def take_pd_transfer_stats(self):
        """`LLMEngine.take_pd_transfer_stats`; safe from any thread (the times are taken, the counters copied)."""
        return self.engine.take_pd_transfer_stats()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_background_in_flight(self) -> int:
        """Of num_in_flight, the streams generated with `background=True`."""
        return len(self._background)

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, *, req_id: str | None = None,
                     **fields: Any) -> EngineRequest:
        """An EngineRequest for a text prompt, token ids or chat messages: `LLMEngine.make_request`."""
        return self.engine.make_request(prompt, params, req_id=req_id, **fields)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Stream deltas for one request. Invalid requests raise InvalidRequestError (DuplicateRequestError
        for an id whose stream is open) before anything is queued.

        Closing or cancelling the consumer aborts the request; its KV blocks are freed by the next step.
        `request.background`: counted apart in `load()` (num_background_*).
        """
        self._ensure_alive()
        req_id = request.req_id
        if req_id in self._streams:
            raise DuplicateRequestError(req_id)
        params = self.engine.check_request(request)          # pure: safe while a step runs
        stream = _Stream(num_seqs=params.n)
        self._streams[req_id] = stream
        if request.background:
            self._background.add(req_id)
        self._pending_adds.append((request, params))
        self._kick()
        finished_seqs = 0
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished_seqs += 1
                    if finished_seqs == stream.num_seqs:
                        stream.finished = True
                        return
        finally:
            if not stream.finished:
                self._pending_aborts.add(req_id)
                self._kick()
            self._streams.pop(req_id, None)
            self._background.discard(req_id)

    async def read_held_kv(self, transfer_id: str, start_block: int, num_blocks: int):
        """P/D (kv_connector.type pd): copy blocks of a prefill's held KV out, on a thread beside the steps
        (a uint8 array [num_blocks, block_bytes]); the hold is freed by the next step, which this wakes."""
        try:
            return await asyncio.to_thread(self.engine.kv_source.read_held_blocks, transfer_id, start_block,
                                           num_blocks)
        finally:
            self._kick()

    def release_held_kv(self, transfer_id: str) -> None:
        """P/D: free a prefill's held KV unread (the decode side needs none of it)."""
        self.engine.kv_source.release_held(transfer_id)
        self._kick()

    def wake_threadsafe(self) -> None:
        """`wake` from any thread (a KV transport's notification thread): scheduled on the engine's event loop.
        A no-op before the engine's loop started or after it closed."""
        loop = getattr(self, "_event_loop", None)
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._kick)
            except RuntimeError:          # closed between the check and the call
                return

    def wake(self) -> None:
        """Run a step now if there is anything to do (P/D: free held KV whose timeout has passed)."""
        self._kick()

    async def abort(self, req_id: str) -> None:
        if req_id in self._streams:
            self._pending_aborts.add(req_id)
            self._kick()

    def check_health(self) -> None:
        """Raise EngineDeadError when the step loop died or the engine failed unrecoverably."""
        reason = self.health().dead_reason
        if reason is not None:
            raise EngineDeadError(reason)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (False when blocks are in use); runs between steps.

        Success starts a new cache epoch, whose first KV event is AllBlocksCleared.
        """
        async with self._step_lock:
            self._collect_kv_events()           # the old epoch's last events, if any were left
            ok = self.engine.reset_prefix_cache()
            self._collect_kv_events()
            self._load = self.engine.load(self._background)
        return ok

    def kv_events_since(self, next_seq: int, epoch: str | None = None,
                        max_events: int | None = 10_000) -> KVEventsReply:
        """KV events numbered `next_seq` on, as the step loop collected them (call on the engine's loop).

        `epoch` is the epoch of the asker's view (None: not checked). `snapshot_required` in the reply
        means the asker cannot follow on (see KVEventsReply): take `kv_snapshot()`. Raises EngineError
        when the engine records no events (cache.enable_kv_cache_events is off).
        """
        if not self._kv_events_enabled:
            raise EngineError("this engine records no KV events: set cache.enable_kv_cache_events")
        return self._kv_events.since(next_seq, epoch, max_events)

    async def kv_snapshot(self) -> KVCacheSnapshot:
        """Every block hash in the prefix cache and the event number to follow on from, taken between
        steps, so `block_hashes` plus events `next_seq`.. of the same epoch is exact."""
        async with self._step_lock:
            self._collect_kv_events()
            return self.engine.kv_snapshot(self._kv_events.next_seq)

    async def shutdown(self) -> None:
        self._stopping = True
        self._kick()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineDeadError("engine shut down"))
        self.engine.close()

    # ------------------------------------------------------------------ loop
    def _ensure_alive(self) -> None:
        self.check_health()
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._event_loop = asyncio.get_running_loop()
            self._loop_task = self._event_loop.create_task(self._run_loop(), name="engine-step-loop")

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request, params in adds:
            if request.req_id in self._pending_aborts:      # cancelled before it was ever queued
                self._pending_aborts.discard(request.req_id)
                continue
            try:
                self.engine.add_checked_request(request, params)
            except Exception as e:      # validated already; anything here fails just this request
                self._fail(request.req_id, e)
        aborts, self._pending_aborts = self._pending_aborts, set()
        if aborts:
            self.engine.abort_request(list(aborts))
        if adds or aborts:
            self._load = self.engine.load(self._background)

    def _collect_kv_events(self) -> None:
        """Only between steps: move the KV pool's new events into the numbered log."""
        if self._kv_events_enabled:
            self._kv_events.append(self.engine.cache_epoch, self.engine.take_kv_events())

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        while not self._stopping:
            self._apply_pending()
            if not self.engine.has_work():
                self.last_progress_time = time.monotonic()
                self._wakeup.clear()
                if self._pending_adds or self._pending_aborts:
                    continue
                wait_s = self.engine.next_wakeup_s()
                if wait_s is None:
                    await self._wakeup.wait()
                else:           # e.g. a P/D hold times out then: step to free it
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), timeout=wait_s + 0.001)
                # Idle is not stuck: the wedge clock restarts with the work that woke us, or a health check
                # during a long first step after an idle spell would call the engine wedged.
                self.last_progress_time = time.monotonic()
                continue
            try:
                async with self._step_lock:
                    if self._step_in_thread:
                        out = await asyncio.to_thread(self.engine.step)
                    else:
                        out = self.engine.step()
            except StepError as e:
                self._collect_kv_events()
                self._load = self.engine.load(self._background)
                self._on_step_failure(e, e.req_ids)
                continue
            except Exception as e:     # a bug outside the runner: nothing is trustworthy any more
                self._die(e)
                return
            self._collect_kv_events()
            if out.stats.num_scheduled_tokens:
                self._consecutive_failures = 0     # only a step that ran the model proves recovery
            self._load = self.engine.load(self._background)
            self.last_progress_time = time.monotonic()
            for d in out.deltas:
                stream = self._streams.get(d.req_id)
                if stream is not None:
                    stream.queue.put_nowait(d)
            await asyncio.sleep(0)

    def _on_step_failure(self, e: StepError, req_ids: set[str]) -> None:
        # The one place a step failure's traceback is logged; the replica logs each request without it.
        logger.error("engine step failed for %d request(s) %s: %s", len(req_ids), sorted(req_ids), e.cause,
                     exc_info=e.cause)
        for rid in req_ids:
            self._fail(rid, e)
        self._consecutive_failures += 1
        if self._consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            self._die(e)

    def _fail(self, req_id: str, e: BaseException) -> None:
        stream = self._streams.get(req_id)
        if stream is not None:
            stream.queue.put_nowait(e)

    def _die(self, e: BaseException) -> None:
        logger.critical("engine is dead: %s", e, exc_info=e)
        self._dead = e
        for rid in list(self._streams):
            self._fail(rid, EngineDeadError(f"engine is dead: {e}"))
