"""A process that pushes less often than the hub's gauge TTL (observability.metrics_push_interval_s may be up to
60 s) keeps its gauges on /metrics between its pushes; they still go once it has missed a few pushes."""
from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.observability import names
from affinity_serve.observability.aggregate import GAUGE_TTL_PUSHES, MetricsAggregate, snapshot_of
from affinity_serve.observability.metrics import ReplicaLoadSample, ReplicaMetrics


def _replica_snapshot(running: int):
    reader = InMemoryMetricReader()
    load = ReplicaLoadSample(num_running=running, num_waiting=0, kv_cache_usage=0.5, prefix_hit_rate=0.0,
                             recent_prefix_hit_rate=0.0, prefix_cache_queries_total=10, prefix_cache_hits_total=4,
                             num_preemptions_total=0)
    ReplicaMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), "r1", lambda: load)
    return snapshot_of(reader.get_metrics_data())


def _running(agg: MetricsAggregate, now: float) -> float | None:
    got = [s.value for (name, _), s in agg.merged(now).items() if name == names.M_RUNNING]
    return got[0] if got else None


def test_gauges_of_a_process_pushing_every_10_s_stay_between_its_pushes_and_go_after_missed_ones():
    agg = MetricsAggregate(gauge_ttl_s=5.0, retire_after_s=300.0)
    for i, t in enumerate((0.0, 10.0, 20.0)):
        agg.push("replica:r1", _replica_snapshot(i + 1), now=t)
    for dt in (0.0, 6.0, 9.9, 12.0):                  # a scrape anywhere before its next push (and one late)
        assert _running(agg, 20.0 + dt) == 3, dt
    assert _running(agg, 20.0 + GAUGE_TTL_PUSHES * 10.0 + 0.1) is None      # it stopped: the gauges go


def test_a_one_second_pusher_keeps_the_5_s_ttl_and_a_stall_fades():
    agg = MetricsAggregate(gauge_ttl_s=5.0, retire_after_s=300.0)
    t = 0.0
    for gap in (0.0, 1.0, 1.0, 1.0):
        t += gap
        agg.push("replica:r1", _replica_snapshot(1), now=t)
    assert _running(agg, t + 5.0) == 1 and _running(agg, t + 5.1) is None
    for gap in (20.0, 1.0, 1.0, 1.0, 1.0, 1.0):       # one 20 s stall, then on time again
        t += gap
        agg.push("replica:r1", _replica_snapshot(1), now=t)
    # the estimate halves at each on-time push (20, 10, 5, 2.5, 1.25, 1): back to the 5 s TTL
    assert _running(agg, t + 5.0) == 1 and _running(agg, t + 5.1) is None


def test_a_declared_interval_keeps_the_gauges_from_the_first_push_and_scrape_pushes_do_not_shorten_it():
    """The exporter sends its push interval: a new process pushing every 10 s keeps its gauges from its first
    push on (the estimate needed a second push), and pushes from /metrics scrapes between its timed ones do not
    shrink the interval (a burst of scrapes made another ingress's gauges vanish before its next push)."""
    agg = MetricsAggregate(gauge_ttl_s=5.0, retire_after_s=300.0)
    agg.push("replica:r1", _replica_snapshot(1), now=0.0, interval_s=10.0)
    assert _running(agg, 6.0) == 1 and _running(agg, 9.9) == 1
    for t in (10.0, 10.01, 10.02, 10.03):             # its timed push, then three scrape pushes at once
        agg.push("replica:r1", _replica_snapshot(2), now=t, interval_s=10.0)
    assert _running(agg, 16.0) == 2 and _running(agg, 19.9) == 2
    assert _running(agg, 10.03 + GAUGE_TTL_PUSHES * 10.0 + 0.1) is None
    # without a declared interval, the estimate from the gaps still applies (older pushers)
    old = MetricsAggregate(gauge_ttl_s=5.0, retire_after_s=300.0)
    old.push("replica:r1", _replica_snapshot(1), now=0.0)
    assert _running(old, 5.0) == 1 and _running(old, 6.0) is None
