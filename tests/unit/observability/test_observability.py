"""Metrics and trace propagation with the OpenTelemetry SDK's in-memory exporter and reader."""
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from affinity_serve.observability.metrics import ReplicaLoadSample, ReplicaMetrics, ServingMetrics
from affinity_serve.observability.tracing import context_from_carrier, extract_context, inject_carrier


def _points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def test_request_and_replica_metrics():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    m = ServingMetrics(meter)
    m.record_request(model="x", prompt_tokens=10, output_tokens=5, cached_tokens=4, ttft_s=0.2, e2e_s=1.0,
                     tpot_s=[0.2])
    ReplicaMetrics(meter, "r1", lambda: ReplicaLoadSample(num_running=3, num_waiting=1, kv_cache_usage=0.5,
                                                          prefix_hit_rate=0.4, recent_prefix_hit_rate=0.75,
                                                          prefix_cache_queries_total=20, prefix_cache_hits_total=8,
                                                          num_preemptions_total=1))
    m.record_http("/v1/completions", 429)
    pts = _points(reader)
    assert pts["affinity_prompt_tokens"][0].value == 10
    assert pts["affinity_cached_prompt_tokens"][0].value == 4
    assert pts["affinity_request_prompt_tokens"][0].sum == 10
    assert pts["affinity_time_to_first_token"][0].sum == 0.2
    assert pts["affinity_time_per_output_token"][0].sum == 0.2
    assert pts["affinity_replica_prefix_cache_hits"][0].value == 8
    assert pts["affinity_replica_prefix_cache_hit_rate"][0].value == 0.4
    assert pts["affinity_replica_recent_prefix_cache_hit_rate"][0].value == 0.75
    assert dict(pts["affinity_replica_running_requests"][0].attributes) == {"replica": "r1"}
    assert dict(pts["affinity_http_requests"][0].attributes) == {"route": "/v1/completions", "status": "429"}


def test_w3c_context_survives_a_dict_carrier():
    exp = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    tracer = tp.get_tracer("t")
    headers = {"Traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    with tracer.start_as_current_span("ingress", context=extract_context(headers)) as span:
        carrier = inject_carrier()
        assert carrier["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    tracer.start_span("replica", context=context_from_carrier(carrier)).end()
    ingress, replica = exp.get_finished_spans()
    assert replica.context.trace_id == ingress.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert replica.parent.span_id == span.get_span_context().span_id


def test_json_logs_carry_request_id():
    import io
    import json
    import logging

    from affinity_serve.observability.logs import JsonFormatter, request_id_var
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(JsonFormatter())
    log = logging.getLogger("affinity.test-json")
    log.addHandler(h)
    log.setLevel("INFO")
    token = request_id_var.set("req-42")
    try:
        log.info("request finished", extra={"status": 200, "e2e_s": 0.5})
    finally:
        request_id_var.reset(token)
    rec = json.loads(buf.getvalue())
    assert rec["request_id"] == "req-42" and rec["message"] == "request finished"
    assert rec["status"] == 200 and rec["e2e_s"] == 0.5 and rec["level"] == "INFO"


def test_json_logs_keep_the_whole_traceback():
    import io
    import json
    import logging

    from affinity_serve.observability.logs import JsonFormatter

    def inner():
        raise ValueError("the real cause")

    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(JsonFormatter())
    log = logging.getLogger("affinity.test-json-exc")
    log.addHandler(h)
    try:
        inner()
    except ValueError:
        log.error("request failed", exc_info=True, extra={"request_id": "req-7"})
    rec = json.loads(buf.getvalue())
    assert rec["exc_type"] == "ValueError" and rec["exc_message"] == "the real cause"
    assert "Traceback (most recent call last)" in rec["traceback"] and "in inner" in rec["traceback"]
    assert rec["request_id"] == "req-7"
