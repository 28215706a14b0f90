"""A process whose push lacks a counter series it reported before (an observable instrument's callback failed
this collection, so the OpenTelemetry SDK left it out) does not take its counts out of the hub's sums: the
app's counter would go back, which Prometheus reads as a reset."""
from __future__ import annotations

import logging

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.observability import names
from affinity_serve.observability.aggregate import MetricsAggregate, snapshot_of
from affinity_serve.observability.metrics import RouterMetrics, RouterSample


class Routers:
    """A process's routers as RouterMetrics reads them; `broken` makes the next read fail."""

    def __init__(self, host: str, events: int) -> None:
        self.host, self.events, self.broken = host, events, False
        self.reader = InMemoryMetricReader()
        RouterMetrics(MeterProvider(metric_readers=[self.reader]).get_meter("t"), self.read)

    def read(self) -> list[tuple[str, RouterSample]]:
        if self.broken:
            raise RuntimeError("a router's sample could not be read")
        return [(self.host, RouterSample("LLMReplica", num_events=self.events))]

    def snapshot(self):
        return snapshot_of(self.reader.get_metrics_data())


def _events(agg: MetricsAggregate, now: float) -> float:
    key = (names.M_ROUTING_FEED_EVENTS, (("deployment", "LLMReplica"),))
    return agg.merged(now)[key].value


def test_a_push_missing_a_counter_series_keeps_its_counts_in_the_sums(caplog):
    a, b = Routers("ing-a", 100), Routers("ing-b", 40)
    agg = MetricsAggregate()
    agg.push("ingress:a", a.snapshot(), now=0.0)
    agg.push("ingress:b", b.snapshot(), now=0.0)
    assert _events(agg, 0.0) == 140
    b.broken, b.events = True, 45
    with caplog.at_level(logging.CRITICAL):         # the SDK logs the failed callback
        gap = b.snapshot()
    assert not any(name == names.M_ROUTING_FEED_EVENTS for name, _ in gap)      # the SDK left the series out
    agg.push("ingress:b", gap, now=1.0)
    assert _events(agg, 1.0) == 140                  # not 100
    b.broken = False
    agg.push("ingress:b", b.snapshot(), now=2.0)
    assert _events(agg, 2.0) == 145
