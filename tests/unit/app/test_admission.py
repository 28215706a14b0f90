"""Admission control (issue 33.8): a request that no replica is predicted to start within
serve.max_queue_wait_s gets 429 with Retry-After before anything is sent; the prediction is the routing
core's TTFT model (queued prefill, running load, KV pressure), computed without recording anything."""
from __future__ import annotations

import asyncio
import random

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from affinity_serve.app.errors import APIError
from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import CompletionRequest, ReplicaChunk
from affinity_serve.app.routing import (AffinityConfig, PrefixAffinityRouterCore, ReplicaInfo, ReplicaLoadView,
                                        RouteRequest)
from affinity_serve.app.routing import debug
from affinity_serve.app.serving import OpenAIServing
from affinity_serve.engine import EngineLimits
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver
from tests.unit.app.conftest import LocalHandle

LIMITS = EngineLimits(max_model_len=256, vocab_size=1000, max_kv_tokens=1024, block_size=4)


class Replica:
    def __init__(self):
        self.calls = 0

    async def limits(self):
        return LIMITS

    async def generate(self, req):
        self.calls += 1
        yield ReplicaChunk("", 0, "", [7], "length", num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")


class FakeRouter:
    """The shell's surface the ingress uses: predicted_wait_s on the router loop."""

    def __init__(self, wait):
        self.wait = wait
        self.asked = []
        self.first_tokens = []

    def predicted_wait_s(self, request_id, prompt_token_ids, block_hashes, max_tokens, bound=None):
        self.asked.append((request_id, len(prompt_token_ids), max_tokens))
        return self.wait

    async def run_on_loop(self, fn, *args):
        return fn(*args)

    def num_replicas(self):
        return 1

    def call_soon(self, fn, *args):
        fn(*args)

    def on_first_token(self, request_id, num_cached_tokens, kv_wait_s=0.0):
        self.first_tokens.append((request_id, num_cached_tokens, kv_wait_s))


class NamedHandle(LocalHandle):
    """A handle with the app and deployment names the router registry is keyed by."""

    def __init__(self, target, app_name):
        super().__init__(target)
        self.__dict__.update(app_name=app_name, deployment_name="LLMReplica")


def _serving(replica, bound, app_name):
    metrics = ServingMetrics(MeterProvider().get_meter("t"))
    handle = NamedHandle(replica, app_name)
    serving = OpenAIServing(handle, model_name="m", tokenizer=None, first_output_timeout_s=5,
                            observer=RequestObserver(TracerProvider().get_tracer("t"), metrics), metrics=metrics,
                            max_queue_wait_s=bound)
    return serving, handle


async def test_a_request_predicted_to_wait_past_the_bound_is_a_429_with_retry_after():
    replica = Replica()
    serving, handle = _serving(replica, bound=10.0, app_name="admission-1")
    router = FakeRouter(wait=13.2)
    debug.register(handle.app_name, handle.deployment_name, router)
    with pytest.raises(APIError) as e:
        await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=list(range(20)), max_tokens=3),
                               "cmpl-1", {})
    assert e.value.status_code == 429 and e.value.code == "queue_full" and e.value.retry_after_s == 4
    assert "serve.max_queue_wait_s" in str(e.value)
    assert replica.calls == 0 and router.asked == [("cmpl-1", 20, 3)]
    router.wait = 2.0                                        # under the bound: admitted
    out = await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=list(range(20)), max_tokens=3),
                                 "cmpl-2", {})
    assert out["choices"] and replica.calls == 1


async def test_no_bound_or_no_prediction_admits():
    replica = Replica()
    serving, handle = _serving(replica, bound=None, app_name="admission-2")
    router = FakeRouter(wait=1e9)
    debug.register(handle.app_name, handle.deployment_name, router)
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3], max_tokens=1), "a", {})
    assert router.asked == [] and replica.calls == 1
    serving.max_queue_wait_s, router.wait = 5.0, None        # a load-only policy predicts nothing
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3], max_tokens=1), "b", {})
    assert replica.calls == 2


def test_the_core_predicts_the_best_ttft_and_records_nothing():
    core = PrefixAffinityRouterCore(AffinityConfig(prefill_tokens_per_s=1000.0, calibrate=False), 4,
                                    clock=lambda: 100.0, rng=random.Random(0))
    core.set_replicas([ReplicaInfo("a"), ReplicaInfo("b")])
    core.on_stats("a", ReplicaLoadView(num_queued_prefill_tokens=20_000))
    core.on_stats("b", ReplicaLoadView(num_queued_prefill_tokens=12_000))
    req = RouteRequest("q", [], 1000, 8)
    wait = core.predict_wait(req, ["a", "b"])
    assert wait == pytest.approx((12_000 + 1000) / 1000.0)
    assert core.loads.num_in_flight == 0 and core.index.num_spec_entries == 0
    assert core.counters().num_decisions == 0
    assert core.predict_wait(req, []) is None


async def test_cancelled_futures_nobody_awaits_are_not_logged_as_errors(caplog):
    """A dropped stream's cancelled replica calls leave futures whose exception nobody retrieves; those
    are not server errors (issue 33.4), any other unretrieved exception is still reported."""
    import gc
    import logging

    class TaskCancelledError(Exception):
        pass

    replica = Replica()
    serving, handle = _serving(replica, bound=None, app_name="admission-3")
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2], max_tokens=1), "x", {})
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        f = loop.create_future()
        f.set_exception(TaskCancelledError("cancelled"))
        del f
        g = loop.create_future()
        g.set_exception(ValueError("a real bug"))
        del g
        gc.collect()
        await asyncio.sleep(0)
    text = caplog.text
    assert "a real bug" in text and "TaskCancelledError" not in text


def test_sustained_overload_is_one_warning_per_kind_every_10_s_not_one_per_refused_request(monkeypatch, caplog):
    import logging

    from affinity_serve.app import errors
    now = [0.0]
    monkeypatch.setattr(errors, "_last_warning", {})
    monkeypatch.setattr(errors.time, "monotonic", lambda: now[0])
    log = logging.getLogger("affinity.test-overload")
    full = APIError("overloaded", 429, "rate_limit_error", None, "queue_full", retry_after_s=1)
    down = APIError("no replica", 503, "service_unavailable", None, "replica_unavailable")
    with caplog.at_level(logging.DEBUG, logger="affinity.test-overload"):
        for i in range(50):
            now[0] = i * 0.1                               # 50 refusals in 5 s
            errors.log_failure(log, full, full)
        errors.log_failure(log, down, down)               # another kind: its own warning
        now[0] = 10.5
        errors.log_failure(log, full, full)
    warnings = [(r.getMessage(), r.status, getattr(r, "similar_since_last_warning", 0))
                for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [("request failed", 429, 0), ("request failed", 503, 0), ("request failed", 429, 49)]
    assert sum(r.levelname == "DEBUG" for r in caplog.records) == 49


async def test_admission_asks_the_router_that_routed_last_not_the_oldest():
    """A process with several handles has several routers (Serve keeps a dropped handle's): admission asks the
    one in use, and so never keeps a kept shell's feed from pausing."""
    replica = Replica()
    serving, handle = _serving(replica, bound=10.0, app_name="admission-newest")
    shell, used = FakeRouter(wait=13.2), FakeRouter(wait=2.0)
    shell.last_routed, used.last_routed = 5.0, 9.0
    debug.register(handle.app_name, handle.deployment_name, shell)              # the oldest
    debug.register(handle.app_name, handle.deployment_name, used)
    out = await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=list(range(20)), max_tokens=3),
                                 "cmpl-n", {})
    assert out["choices"] and used.asked and not shell.asked


async def test_the_ingress_reports_each_first_tokens_kv_wait_to_its_router():
    """The router's TTFT fit leaves out the time a request waited in its engine for KV blocks: the engine
    measures it (RequestDelta.kv_wait_s) and the ingress passes it on with the first token."""
    class Waited(Replica):
        async def generate(self, req):
            self.calls += 1
            yield ReplicaChunk("", 0, "", [7], None, num_prompt_tokens=3, num_cached_tokens=2, kv_wait_s=0.375,
                               replica_id="r1")
            yield ReplicaChunk("", 0, "", [8], "length", num_prompt_tokens=3, num_cached_tokens=2, kv_wait_s=0.375,
                               replica_id="r1")

    serving, handle = _serving(Waited(), bound=None, app_name="admission-kv-wait")
    router = FakeRouter(wait=None)
    debug.register(handle.app_name, handle.deployment_name, router)
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3], max_tokens=2), "w", {})
    assert [(n, w) for _, n, w in router.first_tokens] == [(2, 0.375)]        # once, with the engine's wait
