"""KV tier counters (issue 26): a replica's KVConnectorStats, recorded at the ingress, reach Prometheus
labelled by replica, tier and (load failures) cause."""
from __future__ import annotations

import dataclasses
import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from engine.kv_connector import KVConnectorStats
from observability.metrics import ServingMetrics


def _points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
    return out


def _stats(**kw) -> dict[str, int]:
    return dataclasses.asdict(KVConnectorStats(**kw))


def test_every_connector_counter_is_exported_with_replica_tier_and_cause():
    reader = InMemoryMetricReader()
    m = ServingMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"))
    m.record_kv_tier("r1", "shared", _stats(lookups=5, hit_blocks=12, hit_tokens=48, loads_ok=2, loaded_blocks=9,
                                            loaded_bytes=9000, stored_blocks=7, stored_bytes=7000, stores_failed=1,
                                            evicted_blocks=3, loads_failed=4, load_failures_missing=1,
                                            load_failures_damaged=2, load_failures_timed_out=1))
    m.record_kv_tier("r2", "offload", _stats(lookups=1))
    pts = _points(reader)
    r1 = (("replica", "r1"), ("tier", "shared"))
    assert pts["affinity_kv_tier_lookups"] == {r1: 5, (("replica", "r2"), ("tier", "offload")): 1}
    assert pts["affinity_kv_tier_hit_blocks"][r1] == 12 and pts["affinity_kv_tier_hit_tokens"][r1] == 48
    assert pts["affinity_kv_tier_loads"][r1] == 2 and pts["affinity_kv_tier_loaded_blocks"][r1] == 9
    assert pts["affinity_kv_tier_stored_blocks"][r1] == 7 and pts["affinity_kv_tier_store_failures"][r1] == 1
    assert pts["affinity_kv_tier_evicted_blocks"][r1] == 3
    failures = {dict(k)["cause"]: v for k, v in pts["affinity_kv_tier_load_failures"].items()
                if dict(k)["replica"] == "r1"}
    assert failures == {"missing": 1, "damaged": 2, "timed_out": 1, "error": 0}
    by_dir = {dict(k)["direction"]: v for k, v in pts["affinity_kv_tier_bytes"].items() if dict(k)["replica"] == "r1"}
    assert by_dir == {"loaded": 9000, "stored": 7000}
    # cumulative snapshots: a later report replaces the earlier one
    m.record_kv_tier("r1", "shared", _stats(lookups=6))
    assert _points(reader)["affinity_kv_tier_lookups"][r1] == 6


def test_the_counters_appear_in_prometheus_text():
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest

    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    try:
        m = ServingMetrics(provider.get_meter("t"))
        m.record_kv_tier("r1", "shared", _stats(load_failures_damaged=3, loads_failed=3))
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()          # unregisters its collector from the global registry
    assert re.search(r'affinity_kv_tier_load_failures_total\{cause="damaged",[^}]*replica="r1",tier="shared"\} 3\.0',
                     text), text
