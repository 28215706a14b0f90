"""The Ray Serve shell over the routing core, without a cluster: the KV event feed against fake replicas,
and AffinityRequestRouter's callbacks with stand-in RunningReplicas (Serve's base class, no Ray started)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from affinity_serve.app.builder import router_kwargs
from affinity_serve.app.config import AppConfig
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.app.routing import AffinityConfig, PrefixAffinityRouterCore, ReplicaInfo
from affinity_serve.app.routing.feed import KVEventFeed
from affinity_serve.engine import SamplingParams
from affinity_serve.engine.types import AllBlocksCleared, BlockStored, KVCacheSnapshot, KVEventsReply

H = [bytes([i]) * 8 for i in range(8)]


class FakeReplica:
    """A replica's KV log: stored hashes as events, numbered from 0, epoch changes on reset."""

    def __init__(self, epoch: str = "boot:0", hang: bool = False) -> None:
        self.epoch, self.events, self.hang = epoch, [], hang
        self.calls: list[str] = []

    def store(self, *hashes: bytes) -> None:
        self.events.append(BlockStored(list(hashes), None, [], 4))

    def reset(self) -> None:
        self.epoch = self.epoch.split(":")[0] + ":1"
        self.events.append(AllBlocksCleared())

    def held(self) -> list[bytes]:
        out: dict[bytes, None] = {}
        for e in self.events:
            if isinstance(e, AllBlocksCleared):
                out.clear()
            else:
                out.update(dict.fromkeys(e.block_hashes))
        return list(out)

    async def events_since(self, next_seq: int, epoch: str | None) -> KVEventsReply:
        self.calls.append("events")
        if self.hang:
            await asyncio.sleep(3600)
        if epoch not in (None, self.epoch) or next_seq > len(self.events):
            return KVEventsReply(self.epoch, next_seq, [], len(self.events), True)
        return KVEventsReply(self.epoch, next_seq, self.events[next_seq:], len(self.events), False)

    async def snapshot(self) -> KVCacheSnapshot:
        self.calls.append("snapshot")
        if self.hang:
            await asyncio.sleep(3600)
        return KVCacheSnapshot(self.epoch, len(self.events), self.held())


def _core() -> PrefixAffinityRouterCore:
    core = PrefixAffinityRouterCore(AffinityConfig(), block_size=4)
    core.set_replicas([ReplicaInfo("a"), ReplicaInfo("b")])
    return core


async def _ticks(feed: KVEventFeed, n: int = 1) -> None:
    for _ in range(n):
        await asyncio.gather(*feed.tick())


async def test_feed_snapshots_first_then_follows_events_and_resyncs_after_a_reset():
    core, a, b = _core(), FakeReplica(), FakeReplica()
    a.store(H[0], H[1])
    feed = KVEventFeed(core, lambda: {"a": a, "b": b}, period_s=0.01, timeout_s=1.0)
    await _ticks(feed)
    assert a.calls == ["snapshot"] and core.replicas_needing_snapshot() == []
    assert core.index.num_held("a") == 2
    a.store(H[2])
    await _ticks(feed)
    assert a.calls[-1] == "events" and core.index.num_held("a") == 3
    assert feed.cursors()["a"] == ("boot:0", 2)
    a.reset()
    a.store(H[5])
    await _ticks(feed, 3)                      # events say "another epoch" -> snapshot -> follow on
    assert "snapshot" in a.calls[2:] and core.index.num_held("a") == 1
    assert feed.cursors()["a"] == ("boot:1", len(a.events))


async def test_feed_skips_a_replica_that_does_not_answer_without_delaying_the_others():
    core, a, slow = _core(), FakeReplica(), FakeReplica(hang=True)
    a.store(H[0])
    feed = KVEventFeed(core, lambda: {"a": a, "b": slow}, period_s=0.01, timeout_s=0.05)
    started = feed.tick()
    await asyncio.wait_for(started[0], 1.0)    # a's pull finished while b's hangs
    assert core.index.num_held("a") == 1
    assert [t.done() for t in feed.tick()] == [False] and len(slow.calls) == 1   # b still in flight: not re-sent
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0                # the 0.05 s timeout fires on this loop: poll, a stall can't fail it
    while feed.counters.num_timeouts == 0 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert feed.counters.num_timeouts == 1
    await _ticks(feed)
    assert len(slow.calls) == 2                # retried next period
    feed.stop()


async def test_feed_drops_replicas_that_left():
    core, a = _core(), FakeReplica()
    members = {"a": a}
    feed = KVEventFeed(core, lambda: members, period_s=0.01, timeout_s=1.0)
    await _ticks(feed)
    members.clear()
    await _ticks(feed)
    assert feed.cursors() == {}


# ---------------------------------------------------------------- AffinityRequestRouter with stand-ins
def _router(routing: dict | None = None, block_size: int = 4):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from affinity_serve.app.routing.serve_router import AffinityRequestRouter
    r = AffinityRequestRouter(deployment_id=DeploymentID(name="LLMReplica", app_name="t"),
                              handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1")
    r.initialize_state(routing or {}, block_size)
    return r


def _replica(key: str, stats: dict | None = None):
    from ray.serve._private.common import DeploymentID, ReplicaID
    return SimpleNamespace(replica_id=ReplicaID(key, DeploymentID(name="LLMReplica", app_name="t")),
                           node_id="node-1", routing_stats=stats or {}, _actor_handle=None)


def _pending(req_id: str, hashes: list[bytes]):
    req = GenerateRequest(req_id, list(range(4 * len(hashes) + 1)), SamplingParams(max_tokens=4),
                          block_hashes=hashes)
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="int-" + req_id))


async def test_router_ranks_the_replica_holding_the_prefix_first_and_tracks_the_request():
    router = _router(**router_kwargs(AppConfig.model_validate({"engine": {"cache": {"block_size": 4}}})))
    a, b = _replica("a", {"num_running_reqs": 0, "cache_epoch": "e"}), _replica("b")
    router._sync_members([a, b])
    from affinity_serve.app.routing import KVSnapshot
    router.core.on_snapshot(KVSnapshot("b", "e", 0, H[:4]))
    pending = _pending("r1", H[:4])
    ranks = await router.choose_replicas([a, b], pending)
    assert [[x.replica_id.unique_id for x in rank] for rank in ranks] == [["b"], ["a"]]
    # the request Serve sends on carries who holds how much of its prompt (the autoscaler's refills)
    assert pending.args[0].cached_on == [("b", 16)]
    router.on_request_routed(_pending("r1", H[:4]), b.replica_id, None)
    assert router.core.loads.in_flight("r1") is not None
    router.on_request_completed(b.replica_id, "int-r1")
    assert router.core.loads.in_flight("r1") is None
    state = router.state(5)
    assert state["decisions"][-1]["chosen"] == "b" and state["decisions"][-1]["reason"] == "affinity"
    assert state["replicas"]["b"]["num_held_blocks"] == 4 and state["node_id"] == "node-1"
    left = pending.args[0].routing.value                        # left for the ingress that sent r1
    assert left is not None and left.chosen == "b"


async def test_router_never_raises_and_routes_other_calls_load_only():
    router = _router({"policy": "prefix_affinity"})
    reps = [_replica(k) for k in "abc"]
    router._sync_members(reps)
    router.inject_errors(1)
    pending = _pending("r1", H[:2])
    ranks = await router.choose_replicas(reps, pending)
    assert router.num_shell_errors == 1 and sorted(len(r) for r in ranks) == [1, 2]
    fallback = pending.args[0].routing.value                    # the ingress's span still says why
    assert fallback.reason.value == "fallback" and fallback.chosen == ranks[0][0].replica_id.unique_id
    router.core = None                                          # any failure inside the shell
    assert sum(len(r) for r in await router.choose_replicas(reps, _pending("r2", H[:2]))) == 3
    assert router.num_shell_errors == 2
    assert sum(len(r) for r in await router.choose_replicas(reps, None)) == 3       # pre-warm call
    bad = SimpleNamespace(args=["not a GenerateRequest"], kwargs={}, metadata=None)
    assert sum(len(r) for r in await router.choose_replicas(reps, bad)) == 3


async def test_stats_are_fed_only_when_a_replica_reports_new_ones():
    router = _router({"policy": "power_of_two"})
    seen = []
    router.core.on_stats = lambda rid, view: seen.append((rid, view.num_running))
    router._sync_members([_replica("a", {"num_running_reqs": 1}), _replica("b")])
    router._sync_members([_replica("a", {"num_running_reqs": 1}), _replica("b", {"num_running_reqs": 2})])
    assert seen == [("a", 1), ("b", 2)]
    assert router.feed is None


async def test_a_replica_whose_pulls_keep_timing_out_is_one_warning_and_one_line_when_it_answers(
        caplog, monkeypatch):
    """A broken feed was silent (timeouts at DEBUG): prefix hits were missed with nothing in the log."""
    from affinity_serve.app.routing import feed as feed_mod
    monkeypatch.setattr(feed_mod, "WARN_AFTER_TIMEOUTS", 3)
    core, slow = _core(), FakeReplica(hang=True)
    feed = KVEventFeed(core, lambda: {"b": slow}, period_s=0.01, timeout_s=0.01)
    with caplog.at_level("INFO", logger="affinity_serve.app.routing.feed"):
        for _ in range(6):
            await _ticks(feed)
        assert feed.counters.num_timeouts == 6
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "3 KV event pulls in a row" in warnings[0].getMessage()
        slow.hang = False
        await _ticks(feed)
        assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
            "replica b answers KV event pulls again"]
    feed.stop()


async def test_an_idle_routers_feed_pauses_drops_the_index_and_resyncs_when_it_routes_again():
    """Serve keeps the router of a dropped handle for the process's life: after routing.kv_events_idle_s
    without routing, its feed pulls nothing and its index (the router's memory) is dropped; routing again
    resumes it, from snapshots."""
    core, a, b = _core(), FakeReplica(), FakeReplica()
    a.store(H[0], H[1])
    b.store(H[2])
    core.route(_route_request("r0", [H[0], H[1]]), ["a", "b"])        # a speculative entry too
    now, active = [0.0], [0.0]
    feed = KVEventFeed(core, lambda: {"a": a, "b": b}, period_s=0.01, timeout_s=1.0, clock=lambda: now[0],
                       idle_s=300.0, last_active=lambda: active[0])
    task = asyncio.get_running_loop().create_task(feed.run())
    await _until(lambda: core.index.num_held("a") == 2 and core.index.num_held("b") == 1)
    assert core.index.num_spec_entries > 0
    now[0] = 299.0
    await asyncio.sleep(0.05)
    assert not feed.paused
    now[0] = 300.0                                                   # idle for idle_s
    await _until(lambda: feed.paused)
    assert core.index.num_held("a") == core.index.num_held("b") == 0 and core.index.num_spec_entries == 0
    assert sorted(core.replicas_needing_snapshot()) == ["a", "b"] and feed.cursors() == {}
    assert feed.counters.num_pauses == 1 and feed.health() == {}      # no lag reported while paused
    a_calls, calls = len(a.calls), len(a.calls) + len(b.calls)
    await asyncio.sleep(0.1)
    assert len(a.calls) + len(b.calls) == calls                       # nothing pulled while paused
    active[0] = 300.5                                                 # it routes again
    await _until(lambda: core.index.num_held("a") == 2 and core.replicas_needing_snapshot() == [])
    assert a.calls[a_calls] == "snapshot"                             # resynced from a snapshot
    assert not feed.paused and feed.counters.num_pauses == 1
    task.cancel()


async def test_a_feed_without_an_idle_bound_never_pauses():
    core, a = _core(), FakeReplica()
    now = [0.0]
    feed = KVEventFeed(core, lambda: {"a": a}, period_s=0.01, timeout_s=1.0, clock=lambda: now[0], idle_s=0.0,
                       last_active=lambda: 0.0)
    now[0] = 1e9
    assert not feed.is_idle()


async def _until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _route_request(req_id: str, hashes: list[bytes]):
    from affinity_serve.app.routing import RouteRequest
    return RouteRequest(req_id, hashes, 4 * len(hashes) + 1, 4)


async def test_the_routers_feed_reads_when_it_last_routed_or_predicted():
    router = _router({"policy": "prefix_affinity", "kv_events_idle_s": 120})
    a, b = _replica("a", {"num_running_reqs": 0, "cache_epoch": "e"}), _replica("b")
    router._sync_members([a, b])
    assert router.feed.idle_s == 120
    router.last_active = 0.0
    assert router.feed.last_active() == 0.0 and router.feed.is_idle()
    await router.choose_replicas([a, b], _pending("q1", [H[0]]))
    assert router.feed.last_active() > 0.0 and not router.feed.is_idle()
    router.last_active = 0.0
    router.predicted_wait_s("q2", list(range(9)), [H[0], H[1]], 4)
    assert not router.feed.is_idle()


def test_forgetting_the_index_releases_its_tables_and_keeps_membership_and_counters():
    """A dict keeps its table as keys are deleted: a paused router must not keep its peak index's memory."""
    import sys

    from affinity_serve.app.routing import KVEventBatch
    from affinity_serve.engine.types import MEDIUM_OFFLOAD, BlockStored
    core = _core()
    many = [i.to_bytes(8, "big") for i in range(20_000)]
    core.on_kv_events(KVEventBatch("a", "e", 0, [BlockStored(many, None, [], 4),
                                                 BlockStored(many[:50], None, [], 4, medium=MEDIUM_OFFLOAD)]))
    core.route(_route_request("r0", many[:64] + [b"fresh-%d" % i for i in range(64)]), ["a", "b"])
    index = core.index
    evictions, big = index.num_evictions, sys.getsizeof(index._held)
    assert core.hot.num_groups > 0
    assert index.num_entries == 20_000 and index.num_spec_entries > 0 and index.num_tier_entries > 0
    core.forget_kv_state()
    assert index.num_entries == 0 and index.num_spec_entries == 0 and index.num_tier_entries == 0
    assert sys.getsizeof(index._held) < big / 100 and not index._spec_records
    assert core.hot.num_groups == 0                          # nothing stale to warm a joining replica with
    assert sorted(core.replicas_needing_snapshot()) == ["a", "b"] and index.num_evictions == evictions
    core.on_kv_events(KVEventBatch("a", "f", 0, [BlockStored(many[:8], None, [], 4)]))   # a fresh stream
    assert index.num_held("a") == 8
    assert core.route(_route_request("r1", many[:8]), ["a", "b"]).chosen == "a"
