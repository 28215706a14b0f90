"""AsyncLLMEngine: a background step loop feeding per-request async streams, with abort and health.

Adds and aborts are queued and applied by the loop between steps; each step runs in a worker thread so
the event loop (HTTP, Ray Serve) stays responsive while the model computes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt, StepError
from engine.outputs import StreamDelta
from engine.sampling_params import SamplingParams
from engine.types import SchedulerStats

logger = logging.getLogger(__name__)

_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_seqs: int = 1
    finished: bool = False


@dataclass
class _PendingAdd:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, step_in_thread: bool = True):
        self.engine = engine
        self._step_in_thread = step_in_thread
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._consecutive_failures = 0
        self.last_progress_time = time.monotonic()
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig, **kw: Any) -> "AsyncLLMEngine":
        return cls(LLMEngine(config), **kw)

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> SchedulerStats:
        return self.engine.last_stats

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       **kwargs: Any) -> AsyncIterator[StreamDelta]:
        """Stream deltas for one request. Validation errors raise before anything is queued.

        Closing or cancelling the consumer aborts the request; its KV blocks are freed by the next step.
        kwargs: priority, cache_salt, trace_context.
        """
        self._ensure_alive()
        params = params or SamplingParams()
        request_id = request_id or f"req-{time.monotonic_ns()}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate_prompt_ids(ids)
        self.engine.scheduler.check_limits(len(ids), params.max_tokens)
        stream = _Stream(num_seqs=params.n)
        self._streams[request_id] = stream
        self._pending_adds.append(_PendingAdd(request_id, ids, params, kwargs))
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
                self._pending_aborts.add(request_id)
                self._kick()
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._pending_aborts.add(request_id)
            self._kick()

    def check_health(self) -> None:
        """Raise EngineDeadError when the step loop died or the engine failed unrecoverably."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if self._loop_task is not None and self._loop_task.done():
            raise EngineDeadError("engine step loop exited")

    async def shutdown(self) -> None:
        self._stopping = True
        self._kick()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineDeadError("engine shut down"))

    # ------------------------------------------------------------------ loop
    def _ensure_alive(self) -> None:
        self.check_health()
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="engine-step-loop")

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            if add.request_id in self._pending_aborts:      # cancelled before it was ever queued
                self._pending_aborts.discard(add.request_id)
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt_token_ids, add.params, **add.kwargs)
            except Exception as e:      # validated already; anything here fails just this request
                self._fail(add.request_id, e)
        aborts, self._pending_aborts = self._pending_aborts, set()
        if aborts:
            self.engine.abort_request(list(aborts))

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        while not self._stopping:
            self._apply_pending()
            if not self.engine.has_unfinished_requests() and not self.engine.scheduler.has_pending_output():
                self.last_progress_time = time.monotonic()
                self._wakeup.clear()
                if self._pending_adds or self._pending_aborts:
                    continue
                await self._wakeup.wait()
                continue
            try:
                if self._step_in_thread:
                    out = await asyncio.to_thread(self.engine.step)
                else:
                    out = self.engine.step()
            except StepError as e:
                self._on_step_failure(e, e.req_ids)
                continue
            except Exception as e:     # a bug outside the runner: nothing is trustworthy any more
                self._die(e)
                return
            if out.stats.num_scheduled_tokens:
                self._consecutive_failures = 0     # only a step that ran the model proves recovery
            self.num_steps += 1
            self.last_progress_time = time.monotonic()
            for d in out.deltas:
                stream = self._streams.get(d.request_id)
                if stream is not None:
                    stream.queue.put_nowait(d)
            await asyncio.sleep(0)

    def _on_step_failure(self, e: StepError, req_ids: set[str]) -> None:
        logger.error("engine step failed for %d request(s): %s", len(req_ids), e.cause, exc_info=e.cause)
        for rid in req_ids:
            self._fail(rid, e)
        self._consecutive_failures += 1
        if self._consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            self._die(e)

    def _fail(self, request_id: str, e: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(e)

    def _die(self, e: BaseException) -> None:
        logger.critical("engine is dead: %s", e, exc_info=e)
        self._dead = e
        for rid in list(self._streams):
            self._fail(rid, EngineDeadError(f"engine is dead: {e}"))
