"""RouterMetrics folds a router that is read no more (collected) into retired totals: the summed counters
never go back, its gauges go, and its counts are folded once however many collections follow."""
from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.observability import names
from affinity_serve.observability.metrics import IndexSample, RouterMetrics, RouterSample


def _sample(events: int, evictions: int, deployment: str = "LLMReplica") -> RouterSample:
    return RouterSample(deployment, num_events=events, num_pulls_ok=events // 2,
                        index={"pool": IndexSample(10, 100, evictions)})


def _points(reader) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
    return out


def test_a_router_read_no_more_keeps_its_counts_and_loses_its_gauges():
    live = [("ing", _sample(100, 7)), ("ing:1", _sample(40, 3)), ("ing", _sample(5, 1, "PrefillReplica"))]
    reader = InMemoryMetricReader()
    RouterMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: list(live))
    d, p = (("deployment", "LLMReplica"),), (("deployment", "PrefillReplica"),)
    pool = (("index", "pool"),)
    pts = _points(reader)
    assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 140, p: 5}
    assert pts[names.M_ROUTING_INDEX_EVICTIONS] == {d + pool: 10, p + pool: 1}

    del live[0]                                       # the first LLMReplica router collected
    for _ in range(3):                                # folded once, whatever the number of collections
        pts = _points(reader)
        assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 140, p: 5}
        assert pts[names.M_ROUTING_INDEX_EVICTIONS] == {d + pool: 10, p + pool: 1}
        assert pts[names.M_ROUTING_FEED_PULLS][d + (("outcome", "ok"),)] == 70
        routers = {dict(k)["router"] for k in pts[names.M_ROUTING_INDEX_ENTRIES] if ("deployment", "LLMReplica") in k}
        assert routers == {"ing:1"}                   # its gauges went with it

    live[0] = ("ing:1", _sample(45, 4))               # the survivor counts on
    live.append(("ing:2", _sample(2, 0)))             # a new router of the deployment (its own label)
    pts = _points(reader)
    assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 100 + 45 + 2, p: 5}
    assert pts[names.M_ROUTING_INDEX_EVICTIONS][d + pool] == 7 + 4
    live.clear()                                      # every router gone: the totals stay
    pts = _points(reader)
    assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 147, p: 5}
    assert not pts.get(names.M_ROUTING_INDEX_ENTRIES)
