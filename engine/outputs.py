"""What the engine hands its callers: streamed deltas and finished offline results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from affinity_serve.engine.types import Logprobs, SchedulerStats


@dataclass(slots=True)
class StreamDelta:
    """New tokens and text for one sequence (`index` < n) of one request, from one step.

    `prompt_logprobs` (requests with `SamplingParams.prompt_logprobs`) is set exactly once per request:
    on index 0's delta that carries its first output token, as one entry per prompt token in prompt
    order, the first None (no context). A request aborted or failed before that never gets them.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    #: P/D: a prefill sequence's RemotePrefill (engine.kv_connector.pd), on its finishing delta
    kv_transfer: Any = None


@dataclass(slots=True)
class EngineStepOutput:
    deltas: list[StreamDelta]
    finished_request_ids: set[str]        # parent requests whose every sequence finished this step
    stats: SchedulerStats


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """One request's complete result (offline `LLM.generate`) or its running accumulation."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    #: one entry per prompt token (the first None) when asked for with SamplingParams.prompt_logprobs
    prompt_logprobs: list[Logprobs | None] | None = None

    def add(self, d: StreamDelta) -> None:
        out = self.outputs[d.index]
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        if d.logprobs:
            out.logprobs = (out.logprobs or []) + d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        self.finished = all(o.finish_reason is not None for o in self.outputs)
