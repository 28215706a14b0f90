"""A router collected (its handle dropped, its app redeployed) keeps its counts in the process's routing
counters: two real AffinityRequestRouters (Serve's base class, stand-in replicas, no Ray started) route, one
is dropped and collected, and no exported `affinity_routing_*` counter goes back (Prometheus would read a
reset); each equals what both routers counted."""
from __future__ import annotations

import asyncio
import gc
import logging
import weakref

from prometheus_client.parser import text_string_to_metric_families

from affinity_serve.app.routing import debug
from affinity_serve.observability.aggregate import render, snapshot_of
from affinity_serve.observability.metrics import RouterSample
from affinity_serve.observability.setup import setup_telemetry
from tests.unit.app.test_routing_shell import H, FakeReplica, _pending, _replica

DEPLOYMENT = "RetiredCountsTest"       # this test's series only (other routers may live in the process)


def _router(fakes: dict[str, FakeReplica]):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from affinity_serve.app.routing.serve_router import AffinityRequestRouter
    r = AffinityRequestRouter(deployment_id=DeploymentID(name=DEPLOYMENT, app_name="t"),
                              handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1")
    r.method_client = lambda running: fakes[running.replica_id.unique_id]
    r.initialize_state({"policy": "prefix_affinity", "kv_events_timeout_s": 0.05}, 4)
    return r


def _counters(telemetry) -> dict[tuple[str, tuple], float]:
    text = render(snapshot_of(telemetry.snapshot_reader.get_metrics_data()), "tiny")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.labels.get("deployment") == DEPLOYMENT and s.name.endswith("_total")}


async def _route_through(router, reps, tag: str, num_errors: int) -> None:
    """Feed pulls (one replica never answers: timeouts), events, decisions and shell errors."""
    feed = router.feed
    for _ in range(2):
        await asyncio.gather(*feed.tick(), return_exceptions=True)
    for i in range(3):
        await router.choose_replicas(reps, _pending(f"{tag}{i}", H[:4]))
    router.inject_errors(num_errors)
    # unlogged: a captured log record keeps the error's traceback, and with it the router, alive
    quiet = logging.getLogger("affinity.router")
    quiet.disabled = True
    try:
        for i in range(num_errors):
            await router.choose_replicas(reps, _pending(f"{tag}-err{i}", H[:2]))
    finally:
        quiet.disabled = False
    router.metrics_sample = router.build_metrics_sample()       # what its sampling task leaves every 0.5 s
    feed.stop()


def _expected(samples: list[RouterSample]) -> dict[tuple[str, tuple], float]:
    """Every routing counter series as the sum of the routers' samples."""
    d = (("deployment", DEPLOYMENT), ("model", "tiny"))
    fields = {("affinity_routing_kv_feed_pulls_total", (("outcome", "ok"),)): "num_pulls_ok",
              ("affinity_routing_kv_feed_pulls_total", (("outcome", "timed_out"),)): "num_pulls_timed_out",
              ("affinity_routing_kv_feed_pulls_total", (("outcome", "error"),)): "num_pulls_error",
              ("affinity_routing_kv_feed_events_total", ()): "num_events",
              ("affinity_routing_kv_feed_snapshots_total", ()): "num_snapshots",
              ("affinity_routing_index_resyncs_total", ()): "num_resyncs",
              ("affinity_routing_errors_total", (("where", "core"),)): "num_core_errors",
              ("affinity_routing_errors_total", (("where", "shell"),)): "num_shell_errors",
              ("affinity_routing_rerouted_total", ()): "num_rerouted"}
    out = {(name, tuple(sorted(d + extra))): float(sum(getattr(s, f) for s in samples))
           for (name, extra), f in fields.items()}
    for index in ("pool", "tier"):
        out[("affinity_routing_index_evictions_total", tuple(sorted(d + (("index", index),))))] = \
            float(sum(s.index[index].num_evictions_total for s in samples))
    return out


async def test_a_collected_router_keeps_its_counts_in_the_process_counters():
    telemetry = setup_telemetry()
    a, b = FakeReplica(), FakeReplica(hang=True)
    a.store(*H[:4])
    reps = [_replica("a"), _replica("b")]
    first, second = _router({"a": a, "b": b}), _router({"a": a, "b": b})
    assert debug.install_router_metrics()
    for r in (first, second):
        r._sync_members(reps)
    await _route_through(first, reps, "x", num_errors=2)
    await _route_through(second, reps, "y", num_errors=1)
    final = [first.metrics_sample, second.metrics_sample]
    before = _counters(telemetry)
    d = (("deployment", DEPLOYMENT), ("model", "tiny"))
    shell = ("affinity_routing_errors_total", d + (("where", "shell"),))
    assert before == _expected(final)
    assert before[shell] == 3 and before[("affinity_routing_kv_feed_pulls_total", d + (("outcome", "timed_out"),))] >= 2

    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None, "the dropped router was not collected"
    after = _counters(telemetry)
    assert after.keys() == before.keys()
    went_back = {k: (before[k], after[k]) for k in before if after[k] < before[k]}
    assert not went_back, went_back
    assert after == _expected(final)      # nothing routed since: the dropped router's counts all stay

    # the survivor counts on from there, and the dropped router's counts are folded once only
    second.num_shell_errors += 4
    second.metrics_sample = second.build_metrics_sample()
    for _ in range(2):
        later = _counters(telemetry)
        assert later[shell] == 7
        assert all(later[k] >= after[k] for k in after)
