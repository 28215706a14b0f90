"""The autoscaling policy's decisions on /metrics (autoscale/serve_policy.py `DecisionMetrics`,
observability/metrics.py `AutoscalerMetrics`): EngineAwarePolicy driven with real AutoscalingContext objects, its
private meter rendered as the app's hub renders it; and the exporter's pause while the policy is not called."""
from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from affinity_serve.app.metrics_hub import MetricsExporter
from affinity_serve.autoscale import serve_policy
from affinity_serve.autoscale.pools import PoolPolicy
from affinity_serve.autoscale.serve_policy import EngineAwarePolicy
from affinity_serve.observability.aggregate import MetricsAggregate, render
from tests.unit.autoscale.test_serve_policy import KW, ctx

BUSY = {0: {"num_running": 2.0, "num_queued_prefill_tokens": 2000.0}}


def _series(policy: EngineAwarePolicy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of the policy's metrics as the hub writes them."""
    assert policy.decision_metrics is not None
    text = render(policy.decision_metrics.snapshot(), "m")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _labels(deployment: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"deployment": deployment, "model": "m", **extra}.items()))


def test_a_decision_becomes_the_autoscaler_series_of_its_deployment():
    policy = EngineAwarePolicy(**KW)
    target, _ = policy(ctx(BUSY, 1))        # (2000 / 1 s) / 1000 + 2/10 = 2.2 units at 0.8 -> 3
    assert target == 3
    got = _series(policy)
    lab = _labels("LLMReplica")
    assert got[("affinity_autoscaler_target_replicas", lab)] == 3
    assert got[("affinity_autoscaler_current_replicas", lab)] == 1
    assert got[("affinity_autoscaler_up_target", lab)] == 3
    assert got[("affinity_autoscaler_down_target", lab)] == policy.last.down_target
    assert got[("affinity_autoscaler_load_units", lab)] == pytest.approx(2.2)
    assert got[("affinity_autoscaler_prefill_units", lab)] == pytest.approx(2.0)
    assert got[("affinity_autoscaler_decode_units", lab)] == pytest.approx(0.2)
    assert ("affinity_autoscaler_kv_units", lab) in got and ("affinity_autoscaler_trend_units", lab) in got
    assert got[("affinity_autoscaler_decisions_total", _labels("LLMReplica", reason="up_predicted"))] == 1


def test_every_call_counts_by_reason_and_the_gauges_follow_the_latest_decision():
    policy = EngineAwarePolicy(**KW)
    idle = {i: {"num_running": 0.0} for i in range(3)}
    for now in (0.0, 1.0, 2.0):
        policy(ctx(idle, 3, now=now))                     # downscale_delay_s = 5: waiting
    target, _ = policy(ctx(idle, 3, now=5.5))
    assert target == 1
    got = _series(policy)
    lab = _labels("LLMReplica")
    assert got[("affinity_autoscaler_decisions_total", _labels("LLMReplica", reason="down_pending"))] == 3
    assert got[("affinity_autoscaler_decisions_total", _labels("LLMReplica", reason="down"))] == 1
    assert (got[("affinity_autoscaler_target_replicas", lab)], got[("affinity_autoscaler_current_replicas", lab)]) \
        == (1, 3)
    assert got[("affinity_autoscaler_load_units", lab)] == 0


def test_a_pd_pool_policy_labels_its_own_deployment():
    prefill = PoolPolicy(pool="prefill", **KW)
    c = ctx(BUSY, 1)
    c.deployment_name = "PrefillReplica"
    prefill(c)
    got = _series(prefill)
    assert got[("affinity_autoscaler_target_replicas", _labels("PrefillReplica"))] == prefill.last.target_replicas
    assert all(dict(labels)["deployment"] == "PrefillReplica" for _, labels in got)


def test_outside_a_serve_app_nothing_is_exported_and_in_a_plain_process_nothing_is_pushed():
    policy = EngineAwarePolicy(**KW)
    c = ctx(BUSY, 1)
    c.app_name = ""
    assert policy(c)[0] == 3 and policy.decision_metrics is None
    policy(ctx(BUSY, 1))
    assert policy.decision_metrics is not None
    assert policy.decision_metrics.exporter is None        # no Ray actor here: no thread asking for a hub


def test_a_failing_export_leaves_the_policy_deciding(monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("no meter")
    monkeypatch.setattr(serve_policy, "DecisionMetrics", broken)
    policy = EngineAwarePolicy(**KW)
    assert policy(ctx(BUSY, 1))[0] == 3
    assert policy(ctx(BUSY, 1))[0] == 3
    assert policy.decision_metrics is None
    assert sum("not exported" in r.getMessage() for r in caplog.records) == 1


class _CountingExporter(MetricsExporter):
    """Pushes nowhere: counts the timer's pushes and its questions to `active`."""

    def __init__(self, active):
        self.pushes = 0
        self.asked = 0
        self.is_active = active

        def asked() -> bool:
            self.asked += 1
            return self.is_active()
        super().__init__(InMemoryMetricReader(), "app", "autoscaler:LLMReplica", interval_s=0.005, active=asked)

    def push_once(self) -> None:
        self.pushes += 1


def _wait(cond, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_the_exporter_pushes_only_while_the_policy_is_called():
    """A stale policy (its deployment deleted) stops pushing: the hub lets its gauges go, then retires it."""
    active = threading.Event()
    active.set()
    ex = _CountingExporter(active.is_set)
    try:
        _wait(lambda: ex.pushes >= 2, "no push while active")
        active.clear()
        asked, pushes = ex.asked, ex.pushes
        _wait(lambda: ex.asked >= asked + 3, "the timer stopped asking")
        assert ex.pushes <= pushes + 1           # one push may have been under way when it went stale
        stale = ex.pushes
        _wait(lambda: ex.asked >= asked + 6, "the timer stopped asking")
        assert ex.pushes == stale
        active.set()
        _wait(lambda: ex.pushes > stale, "no push once active again")
    finally:
        ex.close()


def test_decision_metrics_go_stale_when_the_policy_is_no_longer_called(monkeypatch):
    policy = EngineAwarePolicy(**KW)
    policy(ctx(BUSY, 1))
    dm = policy.decision_metrics
    assert dm is not None and dm.active()
    monkeypatch.setattr(serve_policy, "DECISIONS_STALE_AFTER_S", -1.0)    # as if the last call were long ago
    assert not dm.active()


def test_the_hub_drops_a_stale_autoscaler_gauges_and_keeps_its_decision_counts():
    policy = EngineAwarePolicy(**KW)
    policy(ctx(BUSY, 1))
    agg = MetricsAggregate(gauge_ttl_s=5.0, retire_after_s=300.0)
    agg.push("autoscaler:LLMReplica:1", policy.decision_metrics.snapshot(), now=0.0)
    text = render(agg.merged(now=1.0), "m")
    assert "affinity_autoscaler_target_replicas{" in text
    later = render(agg.merged(now=400.0), "m")                # pushed nothing since: retired
    assert "affinity_autoscaler_target_replicas" not in later
    assert 'affinity_autoscaler_decisions_total{deployment="LLMReplica",model="m",reason="up_predicted"} 1.0' \
        in later
