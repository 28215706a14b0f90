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

from collections.abc import Mapping

from affinity_serve.engine.request import Request
from affinity_serve.engine.types import SchedulerOutput


def modelled_step_time_s(so: SchedulerOutput, requests: Mapping[str, Request], step_base_s: float,
                         prefill_per_token_s: float, decode_per_context_token_s: float) -> float:
    """The modelled duration of the step `so` schedules (call it after `schedule()`, before the
    scheduler is updated from the step's output: a decoding request's computed tokens already count this
    step's token)."""
    prefill = ctx = 0
    for req_id, n in so.num_scheduled_tokens.items():
        req = requests.get(req_id)
        if req is not None and n == 1 and req.num_output_tokens > 0:
            ctx += req.num_computed_tokens
        else:
            prefill += n
    return step_base_s + prefill * prefill_per_token_s + ctx * decode_per_context_token_s
