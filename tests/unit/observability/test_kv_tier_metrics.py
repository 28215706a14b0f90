"""KV tier counters (issue 26): a replica's KVConnectorStats, exported by the replica itself, reach Prometheus
labelled by replica, tier and (load failures) cause."""
from __future__ import annotations

import dataclasses
import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.engine.kv_connector import KVConnectorStats
from affinity_serve.observability.aggregate import render, snapshot_of
from affinity_serve.observability.metrics import ReplicaLoadSample, ReplicaMetrics

_IDLE = ReplicaLoadSample(0, 0, 0.0, 0.0, 0.0, 0, 0, 0)


def _points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
    return out


def _stats(**kw) -> dict[str, int]:
    return dataclasses.asdict(KVConnectorStats(**kw))


def _replica(reader, replica_id, tier, counters):
    """A ReplicaMetrics whose connector reports `counters[0]` (a list, so a test can change it)."""
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    return ReplicaMetrics(meter, replica_id, lambda: _IDLE, tier, lambda: counters[0])


def test_every_connector_counter_is_exported_with_replica_tier_and_cause():
    reader = InMemoryMetricReader()
    counters = [_stats(lookups=5, hit_blocks=12, hit_tokens=48, loads_ok=2, loaded_blocks=9, loaded_bytes=9000,
                       stored_blocks=7, stored_bytes=7000, stores_failed=1, evicted_blocks=3, loads_failed=4,
                       load_failures_missing=1, load_failures_damaged=2, load_failures_timed_out=1)]
    _replica(reader, "r1", "shared", counters)
    pts = _points(reader)
    r1 = (("replica", "r1"), ("tier", "shared"))
    assert pts["affinity_kv_tier_lookups"] == {r1: 5}
    assert pts["affinity_kv_tier_hit_blocks"][r1] == 12 and pts["affinity_kv_tier_hit_tokens"][r1] == 48
    assert pts["affinity_kv_tier_loads"][r1] == 2 and pts["affinity_kv_tier_loaded_blocks"][r1] == 9
    assert pts["affinity_kv_tier_stored_blocks"][r1] == 7 and pts["affinity_kv_tier_store_failures"][r1] == 1
    assert pts["affinity_kv_tier_evicted_blocks"][r1] == 3
    failures = {dict(k)["cause"]: v for k, v in pts["affinity_kv_tier_load_failures"].items()}
    assert failures == {"missing": 1, "damaged": 2, "timed_out": 1, "error": 0}
    by_dir = {dict(k)["direction"]: v for k, v in pts["affinity_kv_tier_bytes"].items()}
    assert by_dir == {"loaded": 9000, "stored": 7000}
    # read at every collection: the connector's newer counters, without a request finishing
    counters[0] = _stats(lookups=6)
    assert _points(reader)["affinity_kv_tier_lookups"][r1] == 6


def test_no_connector_no_tier_series():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    ReplicaMetrics(meter, "r1", lambda: _IDLE, "none", lambda: None)
    assert not any(name.startswith("affinity_kv_tier") and pts for name, pts in _points(reader).items())


def test_the_counters_appear_in_prometheus_text():
    reader = InMemoryMetricReader()
    _replica(reader, "r1", "shared", [_stats(load_failures_damaged=3, loads_failed=3)])
    text = render(snapshot_of(reader.get_metrics_data()), "tiny")
    assert re.search(r'^affinity_kv_tier_load_failures_total\{cause="damaged",model="tiny",replica="r1",'
                     r'tier="shared"\} 3\.0$', text, re.M), text
