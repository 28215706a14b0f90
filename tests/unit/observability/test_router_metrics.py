"""Issue 25: the routers' own counters (KV event feed, prefix index, errors) are Prometheus series. Counters
summed over a process's routers of one deployment, gauges per router and per model replica for the feed."""
from __future__ import annotations

import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.observability import names
from affinity_serve.observability.aggregate import MetricsAggregate, render, snapshot_of
from affinity_serve.observability.metrics import FeedReplicaSample, IndexSample, RouterMetrics, RouterSample


def _sample(deployment="LLMReplica", **kw) -> RouterSample:
    base = dict(num_pulls_ok=40, num_pulls_timed_out=3, num_pulls_error=1, num_events=120, num_snapshots=2,
                num_resyncs=1, num_core_errors=0, num_shell_errors=2, num_rerouted=5,
                index={"pool": IndexSample(900, 1000, 7), "tier": IndexSample(0, 500, 0)},
                feed={"r1": FeedReplicaSample(0, 0.1), "r2": FeedReplicaSample(12, 3.5)})
    return RouterSample(deployment, **(base | kw))


def _points(reader) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data is not None else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
    return out


def _metrics(samples):
    reader = InMemoryMetricReader()
    RouterMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: samples[0])
    return reader


def test_router_counters_become_the_named_series_with_their_values():
    samples = [[("ing-a", _sample())]]
    reader = _metrics(samples)
    pts = _points(reader)
    d = (("deployment", "LLMReplica"),)
    assert pts[names.M_ROUTING_FEED_PULLS] == {d + (("outcome", "error"),): 1, d + (("outcome", "ok"),): 40,
                                              d + (("outcome", "timed_out"),): 3}
    assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 120} and pts[names.M_ROUTING_FEED_SNAPSHOTS] == {d: 2}
    assert pts[names.M_ROUTING_INDEX_RESYNCS] == {d: 1} and pts[names.M_ROUTING_REROUTED] == {d: 5}
    assert pts[names.M_ROUTING_ERRORS] == {d + (("where", "core"),): 0, d + (("where", "shell"),): 2}
    assert pts[names.M_ROUTING_INDEX_EVICTIONS] == {d + (("index", "pool"),): 7, d + (("index", "tier"),): 0}
    r = (("deployment", "LLMReplica"),)
    assert pts[names.M_ROUTING_INDEX_ENTRIES] == {r + (("index", "pool"), ("router", "ing-a")): 900,
                                                 r + (("index", "tier"), ("router", "ing-a")): 0}
    assert pts[names.M_ROUTING_INDEX_CAPACITY][r + (("index", "pool"), ("router", "ing-a"))] == 1000
    streak = pts[names.M_ROUTING_FEED_TIMEOUT_STREAK]
    assert streak == {r + (("replica", "r1"), ("router", "ing-a")): 0, r + (("replica", "r2"), ("router", "ing-a")): 12}
    assert pts[names.M_ROUTING_FEED_LAG][r + (("replica", "r2"), ("router", "ing-a"))] == 3.5
    # read at every collection: a newer sample, and a replica the feed dropped has no series any more
    samples[0] = [("ing-a", _sample(num_events=130, feed={"r1": FeedReplicaSample(0, 0.2)}))]
    pts = _points(reader)
    assert pts[names.M_ROUTING_FEED_EVENTS] == {d: 130}
    assert [dict(k)["replica"] for k in pts[names.M_ROUTING_FEED_LAG]] == ["r1"]


def test_counters_sum_over_a_process_routers_and_gauges_stay_per_router():
    samples = [[("ing-a", _sample()), ("ing-a:1", _sample(num_events=5)), ("ing-a", _sample("PrefillReplica"))]]
    pts = _points(_metrics(samples))
    events = {dict(k)["deployment"]: v for k, v in pts[names.M_ROUTING_FEED_EVENTS].items()}
    assert events == {"LLMReplica": 125, "PrefillReplica": 120}
    entries = {(dict(k)["router"], dict(k)["deployment"]) for k, v in pts[names.M_ROUTING_INDEX_ENTRIES].items()}
    assert entries == {("ing-a", "LLMReplica"), ("ing-a:1", "LLMReplica"), ("ing-a", "PrefillReplica")}


def test_no_router_no_series_and_a_load_only_router_has_no_index_or_feed_series():
    assert not any(_points(_metrics([[]])).values())
    pts = _points(_metrics([[("ing-a", RouterSample("LLMReplica", num_rerouted=2))]]))
    assert not pts.get(names.M_ROUTING_INDEX_ENTRIES) and not pts.get(names.M_ROUTING_FEED_LAG)
    assert pts[names.M_ROUTING_REROUTED] == {(("deployment", "LLMReplica"),): 2}


def test_two_ingress_processes_on_one_metrics_page():
    """The hub sums the counters over the app's processes and keeps each router's gauges apart."""
    agg = MetricsAggregate()
    agg.push("ingress:a", snapshot_of(_metrics([[("a", _sample())]]).get_metrics_data()), now=0.0)
    agg.push("ingress:b", snapshot_of(_metrics([[("b", _sample(num_pulls_timed_out=4))]]).get_metrics_data()),
             now=0.0)
    text = render(agg.merged(now=0.0), "tiny")
    assert re.search(r'^affinity_routing_kv_feed_pulls_total\{deployment="LLMReplica",model="tiny",'
                     r'outcome="timed_out"\} 7\.0$', text, re.M), text
    assert re.search(r'^affinity_routing_kv_feed_lag_seconds\{deployment="LLMReplica",model="tiny",replica="r2",'
                     r'router="b"\} 3\.5$', text, re.M), text
    entries = re.findall(r'^affinity_routing_index_entries\{deployment="LLMReplica",index="pool",model="tiny",'
                         r'router="(\w)"\} 900\.0$', text, re.M)
    assert sorted(entries) == ["a", "b"]
    # an ingress gone for good: its gauges go, its counts stay in the totals (a counter never goes back)
    agg.push("ingress:a", snapshot_of(_metrics([[("a", _sample())]]).get_metrics_data()), now=400.0)
    text = render(agg.merged(now=400.0), "tiny")
    assert 'router="b"' not in text
    assert re.search(r'^affinity_routing_kv_feed_pulls_total\{[^}]*outcome="timed_out"\} 7\.0$', text, re.M), text
