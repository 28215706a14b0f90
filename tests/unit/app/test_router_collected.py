"""A router whose handle is dropped is collected, and its long-running tasks on the router loop (the KV event
feed, the metrics sampling) end with it. Serve creates one router per (process, handle) and never stops
these tasks: while they held the router strongly, every dropped handle's router kept pulling every
replica's KV events for the life of the process (a driver calling serve.get_app_handle per request would
pile them up)."""
from __future__ import annotations

import asyncio
import gc
import weakref

from affinity_serve.app.routing import serve_router
from tests.unit.app.test_routing_shell import FakeReplica, _replica, _router


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _queue_len(deadline_s: float) -> int:
    return 0


async def test_a_dropped_router_is_collected_and_its_feed_and_metrics_tasks_end(monkeypatch):
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(serve_router.AffinityRequestRouter, "_event_loop", property(lambda self: loop))
    monkeypatch.setattr(serve_router, "METRICS_SAMPLE_PERIOD_S", 0.01)
    fakes = {k: FakeReplica() for k in "ab"}
    router = _router({"policy": "prefix_affinity", "kv_events_period_s": 0.01})
    router.method_client = lambda running: fakes[running.replica_id.unique_id]
    router._exports_metrics = True                              # as in a process with /metrics
    replicas = [_replica("a"), _replica("b")]
    for r in replicas:                      # Serve's own queue-length probe of a new replica
        r.get_queue_len = _queue_len
    router.update_replicas(replicas)
    tasks = [router._feed_task, router._metrics_task]
    assert all(t is not None and not t.done() for t in tasks)
    ref = weakref.ref(router)
    await _until(lambda: len(fakes["a"].calls) >= 3 and ref().metrics_sample is not None)
    del router
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.02)
    assert ref() is None
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)         # both ended on their own
    pulls = sum(len(f.calls) for f in fakes.values())
    await asyncio.sleep(0.1)
    assert sum(len(f.calls) for f in fakes.values()) == pulls    # nobody pulls for the dropped router


async def test_a_live_routers_feed_survives_serve_unpickling_its_class_again(monkeypatch):
    """Serve pickles the router class by value and unpickles it again at each deployment config update;
    cloudpickle then sets the new function objects on the class already loaded. A feed that held the router
    through a weak bound method lost it there (the method's old function died while the router lived):
    the feed stopped and the router's index never synced again (seen on real Serve)."""
    import cloudpickle

    from affinity_serve.app.routing.serve_router import AffinityRequestRouter
    cloudpickle.register_pickle_by_value(serve_router)
    try:
        blob = cloudpickle.dumps(AffinityRequestRouter)
    finally:
        cloudpickle.unregister_pickle_by_value(serve_router)
    cls = cloudpickle.loads(blob)                       # the class as Serve's router has it
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    router = cls(deployment_id=DeploymentID(name="LLMReplica", app_name="t"),
                 handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1")
    router.initialize_state({"policy": "prefix_affinity"}, 4)
    router._clients = {"a": object()}
    assert router.feed.replicas() == router._clients
    assert cloudpickle.loads(blob) is cls               # a config update: the same class, functions replaced
    gc.collect()
    assert router.feed.replicas() == router._clients    # the router lives: so does its feed's view
