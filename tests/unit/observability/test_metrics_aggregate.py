"""One /metrics view of many processes (issue 32.5): counters summed over ingress replicas stay monotonic
whichever one a scrape reaches, replica gauges are read live and vanish with their replica, vLLM aliases
carry vLLM's label names, and the Prometheus text parses."""
from __future__ import annotations

import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from affinity_serve.app.metrics_hub import MetricsExporter, MetricsHub
from affinity_serve.observability import names
from affinity_serve.observability.aggregate import MetricsAggregate, render, snapshot_of
from affinity_serve.observability.metrics import ReplicaLoadSample, ReplicaMetrics, ServingMetrics


def _process():
    reader = InMemoryMetricReader()
    return reader, MeterProvider(metric_readers=[reader]).get_meter("t")


def _ingress():
    reader, meter = _process()
    return reader, ServingMetrics(meter)


def _load(running: int = 0, **kw) -> ReplicaLoadSample:
    base = dict(num_running=running, num_waiting=0, kv_cache_usage=0.0, prefix_hit_rate=0.0,
                recent_prefix_hit_rate=0.0, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                num_preemptions_total=0)
    return ReplicaLoadSample(**(base | kw))


def _value(text: str, sample: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_counters_are_monotonic_whichever_ingress_a_scrape_reaches():
    """Two ingress replicas, 7 and 3 requests: each scrape (alternating between them, as Serve's proxy
    spreads them) reads 10, then more; never 7, 3, 7, 3."""
    (r1, m1), (r2, m2) = _ingress(), _ingress()
    hub = MetricsHub(warmup_s=0.0)
    for _ in range(7):
        m1.record_http("/v1/completions", 200)
    for _ in range(3):
        m2.record_http("/v1/completions", 200)
    seen = []
    for i in range(6):
        (m1 if i % 3 else m2).record_http("/v1/completions", 200)
        me, other = (("ingress-a", r1), ("ingress-b", r2)) if i % 2 == 0 else (("ingress-b", r2), ("ingress-a", r1))
        hub.push(other[0], snapshot_of(other[1].get_metrics_data()))       # the other one's timer
        text = hub.render(me[0], snapshot_of(me[1].get_metrics_data()), "tiny")
        seen.append(_value(text, "affinity_http_requests_total", status="200"))
    assert seen[0] >= 10 and all(b >= a for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] == 16


def test_a_process_that_stops_keeps_its_counts_and_its_gauges_go():
    agg = MetricsAggregate(gauge_ttl_s=5, retire_after_s=60)
    ing_reader, ing = _ingress()
    ing.record_http("/v1/completions", 200)
    rep_reader, rep_meter = _process()
    ReplicaMetrics(rep_meter, "rep-1", lambda: _load(running=4, prefix_cache_queries_total=9))
    agg.push("ingress-a", snapshot_of(ing_reader.get_metrics_data()), now=0)
    agg.push("replica-1", snapshot_of(rep_reader.get_metrics_data()), now=0)
    text = render(agg.merged(now=1), "tiny")
    assert _value(text, "affinity_replica_running_requests", replica="rep-1") == 4
    assert _value(text, "affinity_http_requests_total") == 1
    text = render(agg.merged(now=10), "tiny")          # silent past the gauge TTL
    assert _value(text, "affinity_replica_running_requests") is None
    assert _value(text, "affinity_replica_prefix_cache_queries_total", replica="rep-1") == 9
    # both retired: the ingress's shared count stays in the total, the replica's own series end
    ing2_reader, ing2 = _ingress()
    ing2.record_http("/v1/completions", 200)
    agg.push("ingress-b", snapshot_of(ing2_reader.get_metrics_data()), now=100)
    text = render(agg.merged(now=100), "tiny")
    assert agg.num_processes == 1
    assert _value(text, "affinity_http_requests_total") == 2
    assert _value(text, "affinity_replica_prefix_cache_queries_total") is None


def test_histograms_sum_bucket_by_bucket():
    (r1, m1), (r2, m2) = _ingress(), _ingress()
    for m, ttft in ((m1, 0.02), (m2, 0.02), (m2, 3.0)):
        m.record_request(model="tiny", prompt_tokens=4, output_tokens=2, cached_tokens=0, ttft_s=ttft, e2e_s=4.0)
    agg = MetricsAggregate()
    agg.push("a", snapshot_of(r1.get_metrics_data()), now=0)
    agg.push("b", snapshot_of(r2.get_metrics_data()), now=0)
    text = render(agg.merged(now=0))
    assert _value(text, "affinity_time_to_first_token_seconds_count") == 3
    assert _value(text, "affinity_time_to_first_token_seconds_bucket", le="0.025") == 2
    assert _value(text, "affinity_time_to_first_token_seconds_bucket", le="5.0") == 3
    assert _value(text, "affinity_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert abs(_value(text, "affinity_time_to_first_token_seconds_sum") - 3.04) < 1e-9


def test_replica_gauges_are_read_at_each_collection():
    """Issue 32.5: with requests running the gauges read them; no request has to finish first."""
    reader, meter = _process()
    live = [_load(running=8, num_waiting=3, kv_cache_usage=0.25)]
    ReplicaMetrics(meter, "rep-1", lambda: live[0])
    text = render(snapshot_of(reader.get_metrics_data()), "tiny")
    assert _value(text, "affinity_replica_running_requests", replica="rep-1") == 8
    assert _value(text, "vllm:num_requests_waiting", model_name="tiny", replica="rep-1") == 3
    live[0] = _load(running=2)
    text = render(snapshot_of(reader.get_metrics_data()), "tiny")
    assert _value(text, "affinity_replica_running_requests", replica="rep-1") == 2


def test_sequences_count_by_finish_reason_with_phase_histograms_and_vllm_aliases():
    reader, meter = _process()
    rep = ReplicaMetrics(meter, "rep-1", lambda: _load(num_preemptions_total=5))
    rep.record_sequence(finish_reason="length", queue_s=0.001, prefill_s=0.02, decode_s=0.3)
    rep.record_sequence(finish_reason="stop", queue_s=0.001, prefill_s=0.02, decode_s=0.3)
    rep.record_sequence(finish_reason="abort")
    text = render(snapshot_of(reader.get_metrics_data()), "tiny")
    assert _value(text, "affinity_requests_finished_total", finish_reason="abort") == 1
    assert _value(text, "vllm:request_success_total", finished_reason="length", model_name="tiny") == 1
    assert _value(text, "affinity_request_queue_time_seconds_count") == 2     # aborted: no phase times
    assert _value(text, "vllm:request_prefill_time_seconds_count", model_name="tiny") == 2
    assert _value(text, "vllm:request_decode_time_seconds_sum") == 0.6
    assert _value(text, "vllm:num_preemptions_total", replica="rep-1") == 5
    assert 'model="tiny"' in text and 'model_name="tiny"' in text
    assert "vllm:" not in render(snapshot_of(reader.get_metrics_data()), "tiny", vllm_aliases=False)


def test_every_rendered_sample_is_a_declared_series_and_label_values_are_escaped():
    reader, meter = _process()
    ing = ServingMetrics(meter)
    ing.record_http('/v1/"odd"\\path\n', 404)
    ing.record_routing(reason="affinity", decision_time_s=1e-4, predicted_cached_tokens=8, actual_cached_tokens=8)
    ReplicaMetrics(meter, "rep-1", lambda: _load())
    text = render(snapshot_of(reader.get_metrics_data()), "tiny")
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples <= names.exported_series(), samples - names.exported_series()
    assert _value(text, "affinity_http_requests_total", route='/v1/"odd"\\path\n') == 1
    assert re.search(r"^# TYPE affinity_routing_decision_time_seconds histogram$", text, re.M)


async def test_outside_serve_the_exporter_renders_this_process_only():
    reader, meter = _process()
    ServingMetrics(meter).record_http("/v1/completions", 200)
    exporter = MetricsExporter(reader, app_name=None, process="ingress:local")
    assert exporter._thread is None                     # nothing to push to
    text = await exporter.render("tiny")
    assert _value(text, "affinity_http_requests_total", model="tiny") == 1


def test_a_new_hub_renders_nothing_until_every_process_had_time_to_push(monkeypatch):
    """A hub just made (the first, or one re-created after it was killed) holds only the pushes of its first
    moments: its merge then would be one process's counts read as the app's (a counter reset to Prometheus),
    so it renders nothing (the scrape fails) for its warm-up, while still taking the caller's snapshot."""
    import time as time_mod

    (r1, m1), (r2, m2) = _ingress(), _ingress()
    m1.record_http("/v1/completions", 200)
    m2.record_http("/v1/completions", 200)
    now = [1000.0]
    monkeypatch.setattr(time_mod, "monotonic", lambda: now[0])
    hub = MetricsHub(warmup_s=3.0)
    assert hub.render("ingress-a", snapshot_of(r1.get_metrics_data()), "tiny") is None
    now[0] += 1.0
    hub.push("ingress-b", snapshot_of(r2.get_metrics_data()))
    now[0] += 2.0
    text = hub.render("ingress-a", snapshot_of(r1.get_metrics_data()), "tiny")
    assert _value(text, "affinity_http_requests_total", status="200") == 2


def test_a_new_hub_waits_three_of_the_longest_push_intervals_it_was_told_of(monkeypatch):
    """observability.metrics_push_interval_s may be 10 s: 3 s would let a scrape through before the other
    processes' first pushes."""
    import time as time_mod

    (r1, m1), (r2, m2) = _ingress(), _ingress()
    m1.record_http("/v1/completions", 200)
    m2.record_http("/v1/completions", 200)
    now = [1000.0]
    monkeypatch.setattr(time_mod, "monotonic", lambda: now[0])
    hub = MetricsHub(warmup_s=3.0)
    hub.push("replica-1", snapshot_of(r2.get_metrics_data()), 10.0)
    now[0] += 29.0
    assert hub.render("ingress-a", snapshot_of(r1.get_metrics_data()), "tiny", True, 10.0) is None
    now[0] += 1.0
    assert hub.render("ingress-a", snapshot_of(r1.get_metrics_data()), "tiny", True, 10.0) is not None


def test_a_hub_past_its_warm_up_with_nothing_pushed_is_not_an_empty_scrape():
    """An app whose model replicas are still loading: the warm-up had passed and the scrape was a 200 with an
    empty body (acceptance: 8 s of them), which reads as "no series"; None (the exporter's 503) until a process
    has pushed a sample."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader])         # no instrument: what a process that recorded nothing sends
    hub = MetricsHub(warmup_s=0.0)
    assert hub.render("ingress-a", snapshot_of(reader.get_metrics_data()), "tiny") is None
    (r1, m1) = _ingress()
    m1.record_http("/v1/completions", 200)
    text = hub.render("ingress-a", snapshot_of(r1.get_metrics_data()), "tiny")
    assert _value(text, "affinity_http_requests_total", status="200") == 1
