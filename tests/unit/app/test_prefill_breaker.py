"""P/D: a prefill replica that missed disaggregation.prefill_timeout_s is held back by the decode replica
(app/disagg.py PrefillBreaker, applied by its router over the prefill pool, app/disagg_router.py
PrefillPoolRouter): its calls go to another prefill replica, or with none are prefilled at once on the decode
replica, for prefill_backoff_s; then one request tries it again. Without it, every request routed to a hung
prefill replica waited prefill_timeout_s until Serve's health check replaced it."""
from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

from affinity_serve.app.disagg import DecodeReplica, PrefillBreaker, PrefillResult
from affinity_serve.app.disagg_router import PrefillPoolRouter
from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
from affinity_serve.engine import RemotePrefill, SamplingParams
from tests.unit.app.test_disagg_routing import _kwargs, _pending, _replica
from tests.unit.app.test_prefill_pool_down import _counting_decode

_apps = itertools.count()


def test_a_timeout_holds_the_replica_back_then_one_request_tries_it_again():
    b = PrefillBreaker(backoff_s=10.0)
    assert b.claim(["X"], "r1", 100.0) == ["X"]
    b.on_timeout("X", 100.0)
    assert b.blocked("X", "r2", 105.0) and b.claim(["X"], "r2", 105.0) == []       # one replica: skip the pool
    assert b.claim(["X", "Y"], "r3", 105.0) == ["Y"]                                 # two: the other one
    assert b.state(105.0) == {"X": 5.0}
    # past the back-off: the first request alone tries X again, the others still avoid it meanwhile
    assert b.claim(["X"], "r4", 110.0) == ["X"]
    assert b.claim(["X"], "r5", 110.5) == [] and b.claim(["X"], "r4", 110.5) == ["X"]
    b.on_timeout("X", 111.0)                                                         # it missed again
    assert b.claim(["X"], "r6", 115.0) == []
    assert b.claim(["X"], "r6", 121.0) == ["X"]
    b.on_answer("X")                                                                 # it answered: cleared
    assert b.claim(["X"], "r7", 121.0) == ["X"] and b.state(121.0) == {}
    # a try that ended without telling (cancelled, failed) lets the next request try
    b.on_timeout("X", 200.0)
    assert b.claim(["X"], "r8", 210.0) == ["X"] and b.claim(["X"], "r9", 210.0) == []
    b.release("r8")
    assert b.claim(["X"], "r9", 210.0) == ["X"]
    # with another replica to call, the router sends a request to X past its back-off: that one tries it
    b.on_timeout("X", 300.0)
    assert b.claim(["X", "Y"], "r10", 310.0) == ["X", "Y"]
    b.on_routed("X", "r10", 310.0)
    assert b.claim(["X", "Y"], "r11", 310.0) == ["Y"]
    # a replica no longer running (Serve replaced it) is forgotten
    b.claim(["Y"], "r12", 310.0)
    assert b.state(310.0) == {}


def _prefill_router(keys: list[str]):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    app = f"breaker{next(_apps)}"
    r = PrefillPoolRouter(deployment_id=DeploymentID(name="PrefillReplica", app_name=app),
                          handle_source=DeploymentHandleSource.REPLICA, self_node_id="A")
    r.initialize_state(**_kwargs())
    reps = [_replica(app, "PrefillReplica", k, "A") for k in keys]
    r._sync_members(reps)
    return app, r, reps


async def test_the_prefill_router_leaves_a_held_back_replica_out_while_another_can_take_the_call():
    _, r, reps = _prefill_router(["pX", "pY"])
    r.breaker = b = PrefillBreaker(backoff_s=30.0)
    b.on_timeout("pX", time.monotonic())
    pinned = _pending("x", [b"h" * 8])
    pinned.args[0].prefill_replica = "pX"                   # the ingress picked X (its view has no breaker)
    ranks = await r.choose_replicas(reps, pinned)
    assert {rep.replica_id.unique_id for rank in ranks for rep in rank} == {"pY"} and r.num_held_back == 1
    # X alone: not left out (the decode replica prefills such a request itself before it calls)
    alone = await r.choose_replicas(reps[:1], _pending("y", [b"h" * 8]))
    assert [rep.replica_id.unique_id for rank in alone for rep in rank] == ["pX"]
    # the replica each call went to, and those offered to Serve for it, are kept for the decode replica
    r.on_request_routed(pinned, reps[1].replica_id, None)
    assert r.routed_to == {"x": "pY"} and r.offered == {"x": ["pY"], "y": ["pX"]}


class _RoutedPool:
    """The prefill pool's handle in a decode replica: each call is routed by the real PrefillPoolRouter over
    stand-in replicas and answered by the one chosen, unless `hung` holds its key (alive, never answering)."""

    deployment_name = "PrefillReplica"

    def __init__(self, app: str, router: PrefillPoolRouter, replicas: list):
        self.app_name, self.router, self.replicas = app, router, replicas
        self.hung: set[str] = set()
        self.unreachable: set[str] = set()       # never takes a call: Serve's queue-length probe goes unanswered
        self.sent: list[str] = []
        self.num_routing_attempts = 0
        self.prefill = SimpleNamespace(remote=self._remote)

    def _remote(self, call: GenerateRequest, skip: int):
        return self._answer(call)

    async def _answer(self, call: GenerateRequest) -> list[PrefillResult]:
        pending = SimpleNamespace(args=[call], kwargs={}, metadata=SimpleNamespace(
            internal_request_id="int-" + call.req_id))
        while True:                               # Serve routes again until a replica takes the call
            self.num_routing_attempts += 1
            chosen = (await self.router.choose_replicas(self.replicas, pending))[0][0]
            key = chosen.replica_id.unique_id
            if key not in self.unreachable:
                break
            await asyncio.sleep(0.02)
        self.router.on_request_routed(pending, chosen.replica_id, None)
        self.sent.append(key)
        if key in self.hung:
            await asyncio.Event().wait()
        return [PrefillResult(ReplicaChunk(call.req_id, 0, "a", [7], "length", replica_id=key),
                              RemotePrefill(key, f"t-{call.req_id}", "k", 8, 2, 7))]


def _decode_over(keys: list[str], monkeypatch, backoff_s: float):
    from affinity_serve.app.replica import LLMReplica

    async def engine_generate(self, req):          # LLMReplica.generate: one more token from this engine
        yield ReplicaChunk(req.req_id, 0, "b", [8], "length", replica_id=self.replica_id)

    monkeypatch.setattr(LLMReplica, "generate", engine_generate)
    app, router, reps = _prefill_router(keys)
    pool = _RoutedPool(app, router, reps)
    d = _counting_decode(None)
    del d._call_prefill, d._prefill_pool_down
    d.prefill_handle, d.prefill_timeout_s, d.pool_watch_s = pool, 0.3, 0.01
    d.prefill_min_replicas, d._pool_was_empty, d._pool_seen_replicas = 1, False, False
    d.prefill_breaker = PrefillBreaker(backoff_s)
    return d, pool


async def _request(d: DecodeReplica, req_id: str, pin: str | None = None) -> list[ReplicaChunk]:
    req = GenerateRequest(req_id, list(range(16)), SamplingParams(max_tokens=4))
    req.prefill_replica = pin
    return [c async for c in d.generate(req)]


async def test_with_one_prefill_replica_a_hung_one_is_skipped_until_its_back_off_ends(monkeypatch):
    d, pool = _decode_over(["pX"], monkeypatch, backoff_s=0.5)
    pool.hung.add("pX")
    await _request(d, "r1")                                   # waits prefill_timeout_s, recomputed here
    assert pool.sent == ["pX"] and d.disagg.prefill_timeouts == 1 and d.disagg.prefill_failed == 1
    out = await _request(d, "r2")                             # X held back: prefilled here, X not called
    assert [c.token_ids for c in out] == [[8]]
    assert pool.sent == ["pX"] and d.disagg.prefill_suspect == 1 and d.disagg.prefill_timeouts == 1
    assert "pX" in d.prefill_breaker.state(time.monotonic())
    pool.hung.clear()                                         # X runs again
    deadline = time.monotonic() + 30
    while d.prefill_breaker.blocked("pX", "r3", time.monotonic()):
        assert time.monotonic() < deadline, "the back-off never ended"
        await asyncio.sleep(0.05)
    out = await _request(d, "r3")                             # tried again: it answers, and is cleared
    assert pool.sent == ["pX", "pX"] and d.disagg.remote == 1 and d.prefill_breaker.state(time.monotonic()) == {}
    assert [c.token_ids for c in out] == [[7], [8]]


async def test_with_two_prefill_replicas_the_other_one_takes_the_calls(monkeypatch):
    d, pool = _decode_over(["pX", "pY"], monkeypatch, backoff_s=60.0)
    pool.hung.add("pX")
    await _request(d, "r1", pin="pX")                         # the ingress picked X: it times out
    assert pool.sent == ["pX"] and d.disagg.prefill_timeouts == 1
    out = await _request(d, "r2", pin="pX")                   # picked again: Y prefills it, nobody waits
    assert pool.sent == ["pX", "pY"] and d.disagg.remote == 1 and d.disagg.prefill_suspect == 0
    assert [c.token_ids for c in out] == [[7], [8]] and d.disagg.prefill_timeouts == 1


async def test_a_call_serve_could_never_send_holds_back_the_replicas_it_was_offered(monkeypatch):
    """A replica hung for longer than Serve's queue-length cache: Serve's probe of it goes unanswered, so the call
    is never sent and waits in Serve's router until the timeout; the replica it was offered is held back too."""
    d, pool = _decode_over(["pX"], monkeypatch, backoff_s=60.0)
    pool.unreachable.add("pX")
    await _request(d, "r1")
    assert pool.sent == [] and d.disagg.prefill_timeouts == 1 and "pX" in d.prefill_breaker.state(time.monotonic())
    attempts = pool.num_routing_attempts
    await _request(d, "r2")                                   # prefilled here: not queued behind X again
    assert pool.num_routing_attempts == attempts and d.disagg.prefill_suspect == 1
