"""OpenTelemetry SDK set-up for one process: tracer + meter providers and their exporters (idempotent)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_telemetry: "Telemetry | None" = None


class BoundedMemorySpanExporter(SpanExporter):
    """Keeps the last `max_spans` finished spans (the SDK's in-memory exporter grows without bound)."""

    def __init__(self, max_spans: int = 2000):
        from collections import deque
        self._spans: Any = deque(maxlen=max_spans)
        self._lock = threading.Lock()

    def export(self, spans) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def get_finished_spans(self) -> list:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def shutdown(self) -> None:
        self.clear()


@dataclass
class Telemetry:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    span_exporter: BoundedMemorySpanExporter | None
    #: collected on demand: the process's snapshot for the app's merged /metrics (app/metrics_hub.py)
    snapshot_reader: InMemoryMetricReader

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracer_provider.get_tracer("affinity-serve")

    @property
    def meter(self) -> metrics.Meter:
        return self.meter_provider.get_meter("affinity-serve")


def setup_telemetry(service_name: str = "affinity-serve", traces: str = "memory", otlp_endpoint: str | None = None,
                    max_spans_kept: int = 2000, extra_readers: list[MetricReader] | None = None) -> Telemetry:
    """Create (once per process) the providers; later calls return the same Telemetry. Metrics are read by
    `snapshot_reader` (the app's /metrics merges every process's: app/metrics_hub.py) and, with
    `otlp_endpoint`, exported over OTLP."""
    global _telemetry
    with _lock:
        if _telemetry is not None:
            return _telemetry
        resource = Resource.create({"service.name": service_name})
        tp = TracerProvider(resource=resource)
        mem = None
        if traces == "memory":
            mem = BoundedMemorySpanExporter(max_spans_kept)
            tp.add_span_processor(SimpleSpanProcessor(mem))
        elif traces == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            tp.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif traces == "otlp":
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            tp.add_span_processor(BatchSpanProcessor(_otlp_span_exporter(otlp_endpoint)))
        snapshots = InMemoryMetricReader()
        readers: list[MetricReader] = [snapshots, *(extra_readers or [])]
        if otlp_endpoint:
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(otlp_endpoint)))
        mp = MeterProvider(resource=resource, metric_readers=readers)
        _telemetry = Telemetry(tp, mp, mem, snapshots)
        return _telemetry


def current_telemetry() -> Telemetry | None:
    """This process's Telemetry if `setup_telemetry` ran (a component that only adds instruments to the
    process's, such as the routers' metrics, must not set it up with defaults itself)."""
    return _telemetry


def reset_telemetry_for_tests() -> None:
    global _telemetry
    with _lock:
        _telemetry = None


def _otlp_span_exporter(endpoint: str | None):
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise RuntimeError("OTLP export needs `pip install 'affinity-serve[otlp]'`") from e
    return OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces" if endpoint else None)


def _otlp_metric_exporter(endpoint: str):
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    except ImportError as e:
        raise RuntimeError("OTLP export needs `pip install 'affinity-serve[otlp]'`") from e
    return OTLPMetricExporter(endpoint=f"{endpoint.rstrip('/')}/v1/metrics")
