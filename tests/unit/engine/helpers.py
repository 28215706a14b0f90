"""Scheduler test helpers: requests and hand-made runner outputs (no model)."""
from __future__ import annotations

import zlib
from collections.abc import Callable

from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.request import Request
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.types import ModelRunnerOutput, SchedulerOutput, StepOutput

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
                   **sched_kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_kv_cache_events=True)
    return Scheduler(SchedulerConfig(**sched_kwargs), kv, max_model_len)


def make_request(req_id: str, prompt: list[int] | int, *, block_size: int = 4, max_tokens: int = 8,
                 priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                 **params) -> Request:
    if isinstance(prompt, int):
        # crc32, not hash(): str hashes change with PYTHONHASHSEED, and tests must not
        prompt = [100 + (zlib.crc32(req_id.encode()) + i) % 1000 for i in range(prompt)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS,
                   arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                   block_size=block_size)


def runner_output(sched: Scheduler, so: SchedulerOutput,
                  token_fn: Callable[[str, int], int] = lambda rid, n: 50 + n) -> ModelRunnerOutput:
    """Sample for every scheduled request whose computed tokens reached its known tokens.

    token_fn(req_id, num_tokens_so_far) decides the token, so resumed requests repeat themselves.
    """
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        sampled.append([token_fn(rid, req.num_tokens)] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(ids, sampled)


def step(sched: Scheduler, token_fn: Callable[[str, int], int] = lambda rid, n: 50 + n
         ) -> tuple[SchedulerOutput, StepOutput]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner_output(sched, so, token_fn))


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, **kw) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, out = step(sched, **kw)
        for d in out.outputs:
            outputs.setdefault(d.req_id, []).extend(d.token_ids)
    assert not sched.has_unfinished_requests(), "scheduler did not drain"
    return outputs


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv.req_to_blocks and not sched.requests
    assert not sched.running and len(sched.waiting) == 0
