"""A decode replica skips the prefill pool when Serve's router over it knows no running replica (app/disagg.py:
DecodeReplica.prefill_pool_size / _prefill_pool_down), except for a pool that may scale to zero, and the
builder tells it which pool it has; a call waiting on a pool that loses its last replica is cancelled
(DecodeReplica._call_prefill), and one the pool does not answer within disaggregation.prefill_timeout_s is
cancelled too (a prefill replica that hangs without dying)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.app.disagg import DecodeReplica, DisaggCounters, PrefillTimeout
from affinity_serve.app.routing import debug


class Handle:
    app_name, deployment_name = "pd-unit", "PrefillReplica"

    def __init__(self, populated: bool):
        self.populated = populated

    def running_replicas_populated(self) -> bool:
        return self.populated


class Router:
    def __init__(self, n: int):
        self.n = n

    def num_replicas(self) -> int:
        return self.n


def _decode(handle, min_replicas: int = 1) -> SimpleNamespace:
    from affinity_serve.app.disagg import PrefillBreaker
    d = SimpleNamespace(prefill_handle=handle, prefill_min_replicas=min_replicas, _pool_was_empty=False,
                        _pool_seen_replicas=False, prefill_timeout_s=30.0, disagg=DisaggCounters(),
                        prefill_breaker=PrefillBreaker(10.0))
    d.prefill_pool_size = lambda: DecodeReplica.prefill_pool_size(d)
    d._prefill_routers = lambda: DecodeReplica._prefill_routers(d)
    d._settle_prefill_call = lambda req_id, outcome: DecodeReplica._settle_prefill_call(d, req_id, outcome)
    return d


def test_the_pool_size_is_what_the_router_knows_once_it_has_known_some():
    router = Router(2)
    debug.register(Handle.app_name, Handle.deployment_name, router)
    assert DecodeReplica.prefill_pool_size(_decode(None)) is None               # no prefill pool
    assert DecodeReplica.prefill_pool_size(_decode(object())) is None           # not a Serve handle
    assert DecodeReplica.prefill_pool_size(_decode(Handle(populated=False))) is None     # no set seen yet
    assert DecodeReplica.prefill_pool_size(_decode(Handle(populated=True))) == 2
    router.n = 0
    assert DecodeReplica.prefill_pool_size(_decode(Handle(populated=True))) == 0


def test_an_empty_pool_is_skipped_unless_it_may_scale_to_zero(caplog):
    router = Router(0)
    debug.register(Handle.app_name, Handle.deployment_name, router)
    fixed = _decode(Handle(populated=True))
    # Serve's handle says populated while this router still counts none (the first set on its way, as seen at
    # start-up): not "down", the call waits for the set
    assert not DecodeReplica._prefill_pool_down(fixed)
    router.n = 1
    assert not DecodeReplica._prefill_pool_down(fixed)
    router.n = 0
    with caplog.at_level("INFO", logger="affinity.disagg"):
        assert DecodeReplica._prefill_pool_down(fixed) and DecodeReplica._prefill_pool_down(fixed)
        router.n = 1
        assert not DecodeReplica._prefill_pool_down(fixed)
    # one line when it empties and one when it is back, not one per request
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    to_zero = _decode(Handle(populated=True), min_replicas=0)
    router.n = 1
    assert not DecodeReplica._prefill_pool_down(to_zero)
    router.n = 0
    assert not DecodeReplica._prefill_pool_down(to_zero)         # its queued calls bring it back


def test_the_builder_passes_the_prefill_pools_floor():
    from affinity_serve.app.builder import disagg_deployments

    def floor(cfg: dict) -> int:
        pd = AppConfig.model_validate({"engine": {"model": "/m", "cache": {"block_size": 4}}, **cfg})
        return disagg_deployments(pd, pd.engine.to_engine_config())._bound_deployment.init_kwargs[
            "prefill_min_replicas"]
    assert floor({"disaggregation": {"enabled": True, "prefill": {"num_replicas": 2}}}) == 2
    assert floor({"autoscaling": {"enabled": True, "min_replicas": 0},
                  "disaggregation": {"enabled": True}}) == 0
    assert floor({"autoscaling": {"enabled": True, "min_replicas": 0},
                  "disaggregation": {"enabled": True, "prefill": {"autoscaling": {"min_replicas": 1}}}}) == 1


def test_a_prompt_past_a_smaller_prefill_pools_length_is_served_on_the_decode_replica(checkpoints):
    """The pools may size their KV pools apart: a prompt the prefill pool cannot hold (its max_model_len, derived
    by the builder from its engine settings) is served here without a call, as ineligible; the call was refused
    there (ContextLengthExceededError) and counted as a prefill failure (acceptance finding)."""
    from affinity_serve.app.builder import disagg_deployments
    from affinity_serve.app.protocol import GenerateRequest
    from affinity_serve.engine import SamplingParams
    pd = AppConfig.model_validate({"engine": {"model": checkpoints["llama"], "device": "cpu",
                                              "cache": {"block_size": 16}},
                                   "disaggregation": {"enabled": True,
                                                      "prefill": {"engine": {"cache": {"num_blocks": 20}}},
                                                      "decode": {"engine": {"cache": {"num_blocks": 30}}}}})
    kwargs = disagg_deployments(pd, pd.engine.to_engine_config())._bound_deployment.init_kwargs
    assert kwargs["prefill_max_model_len"] == 19 * 16             # 20 blocks less the null block
    d = _counting_decode(lambda call, skip: None)
    d.prefill_max_model_len = kwargs["prefill_max_model_len"]
    d.engine.block_size = 16
    fits = GenerateRequest("a", list(range(1, 300)), SamplingParams(max_tokens=8))
    too_long = GenerateRequest("b", list(range(1, 305)), SamplingParams(max_tokens=8))
    assert d._route(fits) == 0 and d.disagg.local_ineligible == 0
    assert d._route(too_long) is None and d.disagg.local_ineligible == 1
    # not derivable (a hub id, a CUDA pool sized by free memory): every long-enough prompt is called as before
    d.prefill_max_model_len = None
    assert d._route(too_long) == 0


class _Response:
    """A Serve response that answers when told to, and records a cancel."""

    def __init__(self):
        self.answered = asyncio.Event()
        self.cancelled = False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        await self.answered.wait()
        return ["prefilled"]

    def cancel(self):
        self.cancelled = True


class _Pool(Handle):
    def __init__(self):
        super().__init__(populated=True)
        self.calls: list[_Response] = []
        self.prefill = SimpleNamespace(remote=self._remote)

    def _remote(self, call, skip):
        self.calls.append(_Response())
        return self.calls[-1]


def test_a_call_waiting_on_a_pool_that_loses_its_last_replica_is_cancelled_and_recomputed_here():
    router = Router(1)
    debug.register(Handle.app_name, Handle.deployment_name, router)
    pool = _Pool()
    d = _decode(pool)
    d.pool_watch_s = 0.01
    d._prefill_pool_down = lambda: DecodeReplica._prefill_pool_down(d)

    async def run():
        # a busy pool (its replica still listed): the call waits for the answer however long it takes
        busy = asyncio.ensure_future(DecodeReplica._call_prefill(d, SimpleNamespace(req_id="a"), 0))
        await asyncio.sleep(0.1)
        assert not busy.done()
        pool.calls[0].answered.set()
        assert await busy == ["prefilled"] and not pool.calls[0].cancelled
        # the replica dies without a clean stop while the call waits in Serve's queue (Serve would hold it
        # until a replacement has started): the call is cancelled and None says "recompute here"
        dead = asyncio.ensure_future(DecodeReplica._call_prefill(d, SimpleNamespace(req_id="b"), 0))
        await asyncio.sleep(0.05)
        assert not dead.done()
        router.n = 0
        assert await asyncio.wait_for(dead, 1.0) is None
        assert pool.calls[1].cancelled
        # the client leaves while the call waits: the call is cancelled too
        router.n = 1
        left = asyncio.ensure_future(DecodeReplica._call_prefill(d, SimpleNamespace(req_id="c"), 0))
        await asyncio.sleep(0.05)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert pool.calls[2].cancelled

    asyncio.run(run())


def test_a_call_the_pool_does_not_answer_in_time_is_cancelled_and_counted():
    router = Router(1)
    debug.register(Handle.app_name, Handle.deployment_name, router)
    pool = _Pool()
    d = _decode(pool)
    d.pool_watch_s, d.prefill_timeout_s = 0.01, 0.2
    d._prefill_pool_down = lambda: DecodeReplica._prefill_pool_down(d)

    async def run():
        # the replica is listed and alive but never answers (hung): the call ends at the deadline, cancelled
        hung = asyncio.ensure_future(DecodeReplica._call_prefill(d, SimpleNamespace(req_id="h"), 0))
        await asyncio.sleep(0.05)
        assert not hung.done()
        with pytest.raises(PrefillTimeout, match="prefill_timeout_s"):
            await asyncio.wait_for(hung, 2.0)
        assert pool.calls[0].cancelled and d.disagg.prefill_timeouts == 1
        # an answer inside the deadline is taken as before, and counts nothing
        d.prefill_timeout_s = 30.0
        ok = asyncio.ensure_future(DecodeReplica._call_prefill(d, SimpleNamespace(req_id="o"), 0))
        await asyncio.sleep(0.05)
        pool.calls[1].answered.set()
        assert await ok == ["prefilled"] and not pool.calls[1].cancelled and d.disagg.prefill_timeouts == 1

    asyncio.run(run())


def test_the_prefill_timeout_defaults_to_half_the_first_token_timeout_and_must_be_below_it():
    base = {"engine": {"model": "/m", "cache": {"block_size": 4}}}
    cfg = AppConfig.model_validate({**base, "serve": {"first_token_timeout_s": 40},
                                    "disaggregation": {"enabled": True}})
    assert cfg.disaggregation.prefill_timeout(cfg.serve.first_token_timeout_s) == 20
    cfg = AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "prefill_timeout_s": 5}})
    assert cfg.disaggregation.prefill_timeout(cfg.serve.first_token_timeout_s) == 5
    with pytest.raises(ValueError, match=r"prefill_timeout_s \(60s\) must be below serve.first_token_timeout_s"):
        AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "prefill_timeout_s": 60}})


def test_the_object_store_transport_records_why_a_transfer_was_not_read():
    from affinity_serve.app.disagg import RayObjectTransport
    from affinity_serve.engine import RemotePrefill
    t = RayObjectTransport()
    for tid, reason in (("a", "local"), ("b", "incompatible")):
        t.release(RemotePrefill("p", tid, "k", 12, 3, 1), reason)
        rec = t.take_record(tid)
        assert rec.outcome == reason and rec.num_blocks == 0


class _CountingEngine:
    """The decode engine's surface the autoscaling stats read; `held` is how many requests it holds."""

    block_size = 4
    pd_block_bytes = 0
    num_background_in_flight = 0

    def __init__(self):
        from affinity_serve.engine.types import EngineLoad
        self.held = 0
        self._load = EngineLoad(0, 0, 0.0, 0, 10, 10, 0, 0, 0, 0, 0, 0, "e:0", 0.0)

    @property
    def num_in_flight(self) -> int:
        return self.held

    def load(self):
        return self._load


def _counting_decode(call_prefill) -> DecodeReplica:
    """A DecodeReplica over a counting engine stand-in; `call_prefill(call, skip)` answers the prefill pool."""
    from opentelemetry.trace import NoOpTracer

    from affinity_serve.app.disagg import RayObjectTransport
    from affinity_serve.autoscale.signals import SignalRecorder
    d = object.__new__(DecodeReplica)
    d.engine, d.signals, d._max_num_seqs, d._last_step_recorded = _CountingEngine(), SignalRecorder(2.0), 8, 0
    d.tracer, d.replica_id, d.transport, d.disagg = NoOpTracer(), "decode-1", RayObjectTransport(), DisaggCounters()
    d.prefill_handle, d.min_remote_prefill_tokens, d.num_waiting_on_prefill = object(), 4, 0
    d._local_hit_blocks = lambda req: 0
    d._prefill_pool_down = lambda: False
    d._call_prefill = call_prefill
    return d


def test_a_pd_request_counts_in_flight_once_in_the_pool_doing_its_work(monkeypatch):
    """P/D: a decode replica counted a request in flight from its prefill call to its end on top of its engine's
    own count: while the prefill pool prefilled it (counted there too) and again while its own engine decoded it
    (2 for one request). Now its in-flight count is its engine's requests, exactly; a request waiting on the
    prefill pool is reported apart (`num_waiting_on_prefill`) until this engine holds it."""
    from affinity_serve.app.disagg import PrefillResult
    from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.engine import RemotePrefill, SamplingParams

    prefilled, decoding, finish = asyncio.Event(), asyncio.Event(), asyncio.Event()
    failed = False

    async def call_prefill(call, skip):
        await prefilled.wait()
        if failed:
            return None                                   # the prefill pool lost its replicas: recomputed here
        return [PrefillResult(ReplicaChunk(call.req_id, 0, "a", [7], "length", replica_id="prefill-1"),
                              RemotePrefill("p", "t1", "k", 8, 2, 7))]

    async def engine_generate(self, req):                 # LLMReplica.generate on the counting engine
        self.engine.held += 1
        try:
            decoding.set()
            await finish.wait()
            yield ReplicaChunk(req.req_id, 0, "b", [8], "length", replica_id=self.replica_id)
        finally:
            self.engine.held -= 1

    monkeypatch.setattr(LLMReplica, "generate", engine_generate)
    d = _counting_decode(call_prefill)

    def stats() -> tuple[float, float]:
        m = d.record_autoscaling_stats()
        return m["num_in_flight"], m["num_waiting_on_prefill"]

    async def one_request() -> None:
        prefilled.clear(), decoding.clear(), finish.clear()
        req = GenerateRequest("r", list(range(16)), SamplingParams(max_tokens=4))
        chunks = asyncio.ensure_future(_collect(d.generate(req)))
        await asyncio.sleep(0.05)
        assert stats() == (0, 1)              # waiting on the prefill pool: counted there, held here
        prefilled.set()
        await asyncio.wait_for(decoding.wait(), 30)
        assert stats() == (1, 0)              # this engine holds it: once
        finish.set()
        await asyncio.wait_for(chunks, 30)
        assert stats() == (0, 0)

    async def run():
        nonlocal failed
        assert stats() == (0, 0)
        await one_request()
        assert d.disagg.remote == 1
        failed = True
        await one_request()                   # recomputed here: the same counts
        assert d.disagg.prefill_failed == 1

    asyncio.run(run())


async def _collect(gen) -> list:
    return [c async for c in gen]


def test_the_decode_pool_does_not_scale_to_zero_under_a_request_waiting_on_the_prefill_pool():
    """The decode pool's policy holds a request waiting on the prefill pool (it holds its stream) without
    counting it as load: idle otherwise, the pool went to zero under it (503) once its to-zero delay passed while
    the prefill pool started from zero."""
    from affinity_serve.autoscale.pools import PoolPolicy
    from tests.unit.autoscale.test_serve_policy import KW, ctx

    kw = {**KW, "min_replicas": 0, "downscale_to_zero_delay_s": 5.0}
    idle = {"num_in_flight": 0.0, "num_recent_requests": 0.0}
    for waiting, to_zero in ((1.0, False), (0.0, True)):
        decode = PoolPolicy(pool="decode", **kw)
        per = {0: {**idle, "num_waiting_on_prefill": waiting}}
        targets = [decode(ctx(per, 1, now=100.0 + t))[0] for t in range(0, 20, 2)]
        assert (targets[-1] == 0) is to_zero, targets
        if not to_zero:
            assert min(targets) == 1
            assert decode.last.load.decode_units == 0.0            # held, not decode load
