"""Ingress and replica logic built synchronously, with fake handles (no Ray cluster)."""
import asyncio
import json

import pytest

from app.config import AppConfig
from app.errors import APIError, to_api_error
from app.protocol import CompletionRequest, ReplicaChunk


class _Gen:
    def __init__(self, agen):
        self._agen = agen
        self.cancelled = False

    def __aiter__(self):
        return self._agen.__aiter__()

    def cancel(self):
        self.cancelled = True


class FakeReplicaHandle:
    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.generate = self
        self.debug_state = self

    def options(self, **_):
        return self

    def remote(self, req=None):
        return _Gen(self.behaviour(req))


def _ingress(checkpoints, behaviour, **serve):
    from app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]},
                                    "serve": {"first_token_timeout_s": 0.3, **serve}})
    return Ingress(FakeReplicaHandle(behaviour), cfg.model_dump())


async def test_no_replica_output_is_503_within_bound(checkpoints):
    async def silent(req):
        await asyncio.sleep(3600)
        yield None

    ing = _ingress(checkpoints, silent)
    t = asyncio.get_running_loop().time()
    with pytest.raises(APIError) as e:
        await ing.completions(CompletionRequest(prompt="hi", max_tokens=2))
    assert e.value.status_code == 503 and e.value.retry_after_s == 1
    assert asyncio.get_running_loop().time() - t < 2


async def test_failure_after_stream_started_is_an_sse_error_then_done(checkpoints):
    async def dies(req):
        yield ReplicaChunk(0, "Hel", [5], replica_id="r1")
        raise APIError("generation failed inside the engine", 500, "server_error", None, "engine_error")

    ing = _ingress(checkpoints, dies)
    gen = ing._stream("completion", CompletionRequest(prompt="hi", max_tokens=5, stream=True), "req-1", {})
    first = await gen.__anext__()
    events = [e async for e in ing._sse(first, gen)]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "Hel"
    err = json.loads(events[1][6:])
    assert err == {"error": {"message": "generation failed inside the engine", "type": "server_error",
                             "param": None, "code": "engine_error"}}
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 3


async def test_context_and_model_checks_happen_before_any_replica_call(checkpoints):
    calls = []

    async def record(req):
        calls.append(req)
        yield ReplicaChunk(0, "", [], finish_reason="length")

    ing = _ingress(checkpoints, record)
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "max_tokens": 10**6})
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        await ing.chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert e.value.param == "top_logprobs"
    assert calls == []


def test_error_mapping_table():
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError
    cases = [
        (BackPressureError(num_queued_requests=3, max_queued_requests=2), 429, "rate_limit_error"),
        (DeploymentUnavailableError.__new__(DeploymentUnavailableError), 503, "service_unavailable"),
        (EngineDeadError("x"), 503, "service_unavailable"),
        (ContextLengthExceededError("too long"), 400, "invalid_request_error"),
        (InvalidRequestError("bad", param="top_p"), 400, "invalid_request_error"),
        (RuntimeError("secret internals\nTraceback"), 500, "server_error"),
    ]
    for exc, status, typ in cases:
        err = to_api_error(exc)
        assert (err.status_code, err.type) == (status, typ), exc
    assert to_api_error(RuntimeError("secret internals")).message == "internal server error"
    assert to_api_error(BackPressureError(num_queued_requests=3, max_queued_requests=2)).retry_after_s == 1


def test_app_config_yaml_and_strictness(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  model: /models/x\n  cache: {block_size: 32}\nserve:\n  num_replicas: 3\n")
    cfg = AppConfig.from_yaml(p)
    assert cfg.engine.cache.block_size == 32 and cfg.serve.num_replicas == 3 and cfg.serve.host == "127.0.0.1"
    p.write_text("serve:\n  num_replicaz: 3\n")
    with pytest.raises(Exception, match="num_replicaz"):
        AppConfig.from_yaml(p)


async def test_replica_reports_small_stats_and_detects_wedge(checkpoints):
    from app.replica import LLMReplica
    from engine.errors import EngineDeadError
    rep = LLMReplica({"model": checkpoints["llama"], "cache": {"num_blocks": 32, "block_size": 4}},
                     wedge_timeout_s=0.05)
    from app.protocol import GenerateRequest
    from engine.sampling_params import SamplingParams
    chunks = [c async for c in rep.generate(GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=3,
                                                                                         temperature=0)))]
    assert chunks[-1].finish_reason == "length" and chunks[-1].timings and chunks[-1].replica_stats
    stats = rep.record_routing_stats()
    assert set(stats) == {"num_running", "num_waiting", "kv_cache_usage", "num_queued_prefill_tokens",
                          "prefix_cache_queries", "prefix_cache_hits", "cache_epoch"}
    assert len(json.dumps(stats)) < 300
    assert all(isinstance(v, float) for v in rep.record_autoscaling_stats().values())
    await rep.check_health()
    epoch = stats["cache_epoch"]
    assert await rep.reset_prefix_cache() and rep.record_routing_stats()["cache_epoch"] != epoch
    # wedge: a running request and no step progress
    sched = rep.engine.engine.scheduler
    sched.running.append(object())
    rep.engine.last_progress_time -= 10
    with pytest.raises(EngineDeadError, match="wedged"):
        await rep.check_health()
    sched.running.pop()
    await rep.engine.shutdown()
