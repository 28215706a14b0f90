"""What LLMEngine.step() returns (its deltas: engine.types.RequestDelta) and the offline API's results."""
from __future__ import annotations

from dataclasses import dataclass, field

from affinity_serve.engine.types import Logprobs, RequestDelta, SchedulerStats


@dataclass(slots=True)
class EngineStepOutput:
    deltas: list[RequestDelta]            # keyed by their request's req_id and index
    finished_req_ids: set[str]            # requests whose every sequence finished this step
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

    def add(self, d: RequestDelta) -> None:
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
