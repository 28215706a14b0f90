"""Issue 25: a real AffinityRequestRouter (Serve's base class, stand-in replicas, no Ray started) leaves its
feed's and index's counters where the process's /metrics reads them: the named series with its values."""
from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from affinity_serve.app.routing import debug
from affinity_serve.observability.aggregate import render, snapshot_of
from affinity_serve.observability.setup import setup_telemetry
from tests.unit.app.test_routing_shell import H, FakeReplica, _pending, _replica

DEPLOYMENT = "RouterMetricsTest"       # the series of this test's router only (others may live in the process)


def _router(fakes: dict[str, FakeReplica]):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from affinity_serve.app.routing.serve_router import AffinityRequestRouter
    r = AffinityRequestRouter(deployment_id=DeploymentID(name=DEPLOYMENT, app_name="t"),
                              handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1")
    r.method_client = lambda running: fakes[running.replica_id.unique_id]
    r.initialize_state({"policy": "prefix_affinity", "kv_events_timeout_s": 0.05}, 4)
    return r


def _series(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.labels.get("deployment") == DEPLOYMENT}


async def test_router_counters_reach_the_process_metrics_with_their_values():
    telemetry = setup_telemetry()                      # the process's (an ingress sets it up before its router)
    a, b = FakeReplica(), FakeReplica(hang=True)
    a.store(*H[:4])
    router = _router({"a": a, "b": b})
    assert debug.install_router_metrics()
    reps = [_replica("a"), _replica("b")]
    router._sync_members(reps)
    feed = router.feed
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while feed.counters.num_timeouts < 2 and loop.time() < deadline:   # b never answers within 0.05 s
        await asyncio.gather(*feed.tick(), return_exceptions=True)
        await asyncio.sleep(0.01)
    a.store(H[4])
    await asyncio.wait_for(asyncio.gather(*[t for t in feed.tick()]), 5.0)   # a's events after its snapshot
    for i in range(3):
        await router.choose_replicas(reps, _pending(f"r{i}", H[:4]))
    router.inject_errors(1)
    await router.choose_replicas(reps, _pending("r3", H[:2]))
    router.metrics_sample = router.build_metrics_sample()      # what its sampling task leaves every 0.5 s
    feed.stop()

    c = feed.counters
    series = _series(render(snapshot_of(telemetry.snapshot_reader.get_metrics_data()), "tiny"))
    d = (("deployment", DEPLOYMENT),)
    assert series[("affinity_routing_kv_feed_pulls_total", d + (("outcome", "timed_out"),))] == c.num_timeouts >= 2
    assert series[("affinity_routing_kv_feed_pulls_total", d + (("outcome", "ok"),))] == \
        c.num_pulls - c.num_timeouts - c.num_errors >= 2
    assert series[("affinity_routing_kv_feed_events_total", d)] == 1            # H[4]
    assert series[("affinity_routing_kv_feed_snapshots_total", d)] == 1
    assert series[("affinity_routing_errors_total", d + (("where", "shell"),))] == 1
    assert series[("affinity_routing_errors_total", d + (("where", "core"),))] == 0
    me = (("router", "local"),)                   # no Serve replica context here
    assert series[("affinity_routing_index_entries", d + (("index", "pool"),) + me)] == 5
    assert series[("affinity_routing_index_capacity", d + (("index", "pool"),) + me)] == \
        router.core.index.bound > 5
    assert series[("affinity_routing_kv_feed_consecutive_timeouts", d + (("replica", "a"),) + me)] == 0
    assert series[("affinity_routing_kv_feed_consecutive_timeouts", d + (("replica", "b"),) + me)] == c.num_timeouts
    lag_a = series[("affinity_routing_kv_feed_lag_seconds", d + (("replica", "a"),) + me)]
    lag_b = series[("affinity_routing_kv_feed_lag_seconds", d + (("replica", "b"),) + me)]
    assert 0 <= lag_a < lag_b                      # b has not answered since the feed first asked it
    assert series[("affinity_routing_kv_feed_paused", d + me)] == 0
    # idle past routing.kv_events_idle_s: paused, said apart from a broken feed (whose lag would grow)
    feed.pause()
    router.metrics_sample = router.build_metrics_sample()
    series = _series(render(snapshot_of(telemetry.snapshot_reader.get_metrics_data()), "tiny"))
    assert series[("affinity_routing_kv_feed_paused", d + me)] == 1
    assert series[("affinity_routing_index_entries", d + (("index", "pool"),) + me)] == 0
    assert not [k for k in series if k[0] == "affinity_routing_kv_feed_lag_seconds"]


async def test_feed_lag_is_the_time_since_a_replica_last_answered():
    from affinity_serve.app.routing.feed import KVEventFeed
    from tests.unit.app.test_routing_shell import _core
    now = [100.0]
    a = FakeReplica()
    feed = KVEventFeed(_core(), lambda: {"a": a}, period_s=0.01, timeout_s=1.0, clock=lambda: now[0])
    await asyncio.gather(*feed.tick())
    now[0] = 102.5
    assert feed.health() == {"a": (0, 2.5)}
    a.hang = True
    feed.timeout_s = 0.01
    await asyncio.gather(*feed.tick())
    now[0] = 104.0
    assert feed.health() == {"a": (1, 4.0)}       # a timed-out pull does not count as an answer
    a.hang = False
    await asyncio.gather(*feed.tick())
    assert feed.health() == {"a": (0, 0.0)}

