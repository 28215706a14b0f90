"""Step pacing: hold each engine step to the time a modelled accelerator would take for it.

A paced replica still runs its real model (the tokens are the model's), then waits until the step has
lasted as long as the model says. On a CPU machine this turns each replica into an independent
"device" of a chosen speed, so that scaling, routing and autoscaling can be exercised with replicas that
each add capacity, the way replicas with one GPU each do (NVIDIA Dynamo's mocker engine and llm-d's
inference simulator serve the same purpose, without a real model).

The model, per step (the routing simulator's TimingModel uses the same formula):

    step time = step_base_s
              + prefill_per_token_s x tokens computed for prompts (chunked prefill included) this step
              + decode_per_context_token_s x context tokens of the sequences decoding this step
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from affinity_serve.engine.config import PaceConfig
from affinity_serve.engine.request import Request
from affinity_serve.engine.types import ModelRunnerOutput, SchedulerOutput


def step_work(so: SchedulerOutput, requests: Mapping[str, Request]) -> tuple[int, int, int]:
    """(prompt tokens computed, sequences decoding, their context tokens) of the step `so` schedules: the
    regressors of the step-time model. Call it after `schedule()`, before the scheduler is updated from the
    step's output (a decoding request's computed tokens then count this step's token)."""
    prefill = num_decode = ctx = 0
    for req_id, n in so.num_scheduled_tokens.items():
        req = requests.get(req_id)
        if req is not None and n == 1 and req.num_output_tokens > 0:
            num_decode += 1
            ctx += req.num_computed_tokens
        else:
            prefill += n
    return prefill, num_decode, ctx


def modelled_step_time_s(so: SchedulerOutput, requests: Mapping[str, Request], step_base_s: float,
                         prefill_per_token_s: float, decode_per_context_token_s: float) -> float:
    """The modelled duration of the step `so` schedules (when to call it: `step_work`)."""
    prefill, _, ctx = step_work(so, requests)
    return step_base_s + prefill * prefill_per_token_s + ctx * decode_per_context_token_s


class PacedRunner:
    """A model runner whose every step lasts at least the modelled device's step time (engine.pace).

    `build_engine_parts` wraps the runner in one only when pacing is enabled, so an unpaced engine's step
    has no pacing code in it. The time counts from the start of `execute_model`: the scheduling before it is
    host time a device would not shorten either.
    """

    def __init__(self, runner: Any, requests: Mapping[str, Request], pace: PaceConfig):
        self.runner = runner                  # the wrapped ModelRunner
        self._requests = requests             # the scheduler's requests (read, never changed)
        self._pace = pace

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        p = self._pace
        # before the forward: a decoding request's computed tokens already count this step's token
        modelled = (modelled_step_time_s(so, self._requests, p.step_base_s, p.prefill_per_token_s,
                                         p.decode_per_context_token_s) if so.num_scheduled_tokens else 0.0)
        out = self.runner.execute_model(so)
        if (wait := modelled - (time.perf_counter() - t0)) > 0:
            time.sleep(wait)
        return out
