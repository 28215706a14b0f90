"""The Serve adapter (autoscale/serve_policy.py) on real AutoscalingContext objects, built by hand, and the
wrapping Serve applies around it (its delays are 0 in our builder, so our decision passes through)."""
from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from affinity_serve.autoscale.serve_policy import EngineAwarePolicy, signals_from_context
from affinity_serve.autoscale.signals import ReplicaSignals

DEP = DeploymentID(name="LLMReplica", app_name="affinity")
KW = dict(min_replicas=1, max_replicas=4, ttft_slo_s=1.0, prefill_tokens_per_s=1000.0,
          decode_seqs_per_replica=10.0, upscale_delay_s=0.0, downscale_delay_s=5.0, headroom_z=0.0,
          trend_lead_s=0.0)   # the linear rule (the headroom and trend terms have their own tests)


def rid(i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"r{i}", deployment_id=DEP)


def ctx(per_replica: dict[int, dict[str, float]], current: int, *, target: int | None = None, now: float = 100.0,
        queued: float = 0.0, running: list[int] | None = None, config: AutoscalingConfig | None = None,
        state: dict | None = None) -> AutoscalingContext:
    agg: dict[str, dict[ReplicaID, float]] = {}
    for i, m in per_replica.items():
        for k, v in m.items():
            agg.setdefault(k, {})[rid(i)] = v
    running = list(per_replica) if running is None else running
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name, current_num_replicas=current,
        target_num_replicas=current if target is None else target, running_replicas=[rid(i) for i in running],
        total_num_requests=0.0, total_queued_requests=queued, aggregated_metrics=agg, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config or AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0,
                                           downscale_delay_s=0))


def test_signals_come_per_running_replica_from_the_aggregated_metrics():
    c = ctx({0: {"num_running": 3.0, "kv_cache_usage": 0.5, "unrelated": 7.0},
             1: {"num_running": 1.0, "ttft_p90_s": 0.2, "num_recent_requests": 4.0},
             2: {"num_running": 50.0}},          # a stopped replica's metrics linger: not counted
            2, running=[0, 1])
    assert signals_from_context(c) == [ReplicaSignals(num_running=3.0, kv_cache_usage=0.5),
                                       ReplicaSignals(num_running=1.0, ttft_p90_s=0.2, num_recent_requests=4.0)]


def test_scales_up_on_a_prefill_backlog_and_reports_the_reason():
    policy = EngineAwarePolicy(**KW)
    target, state = policy(ctx({0: {"num_running": 2.0, "num_queued_prefill_tokens": 2000.0}}, 1))
    assert target == 3                      # (2000 / 1 s) / 1000 + 2/10 = 2.2 units at 0.8 -> 3
    assert state["reason"] == "up_predicted" and state["up_target"] == 3


def test_pending_scale_up_counts_from_the_serve_target_not_the_running_replicas():
    """Serve's target already holds the replicas that are starting: the same load asks for no more."""
    policy = EngineAwarePolicy(**KW)
    m = {0: {"num_running": 2.0, "num_queued_prefill_tokens": 2000.0}}
    assert policy(ctx(m, 1, target=3))[0] == 3


def test_hysteresis_state_lives_in_the_instance_across_ticks():
    policy = EngineAwarePolicy(**KW)
    idle = {i: {"num_running": 0.0} for i in range(3)}
    assert policy(ctx(idle, 3, now=0.0))[1]["reason"] == "down_pending"
    assert policy(ctx(idle, 3, now=4.0))[0] == 3          # downscale_delay_s = 5 not over yet
    target, state = policy(ctx(idle, 3, now=5.5))
    assert (target, state["reason"]) == (1, "down")


def test_callers_queue_blocks_scale_down_and_starts_from_zero():
    policy = EngineAwarePolicy(**{**KW, "min_replicas": 0, "downscale_delay_s": 0.0})
    assert policy(ctx({0: {"num_running": 0.0}, 1: {"num_running": 0.0}}, 2, queued=3.0))[0] == 2
    assert policy(ctx({}, 0, queued=3.0))[0] == 1


@pytest.mark.parametrize("serve_delays,expected", [((0, 0), [3, 1, 1]), ((0, 30), [3, 3, 3])])
def test_serve_wrapper_passes_our_decision_through_when_its_delays_are_zero(serve_delays, expected):
    """Serve wraps a custom policy with its own delays: with 0 (what the builder sets) ours decide alone;
    with Serve's own downscale delay both would have to agree and the fleet would stay up longer."""
    up, down = serve_delays
    cfg = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=up, downscale_delay_s=down)
    wrapped = _apply_autoscaling_config(EngineAwarePolicy(**{**KW, "downscale_delay_s": 0.0}))
    busy = {0: {"num_running": 2.0, "num_queued_prefill_tokens": 2000.0}}
    idle = {i: {"num_running": 0.0} for i in range(3)}
    state: dict = {}
    out = []
    for per, cur, t in [(busy, 1, 0.0), (idle, 3, 1.0), (idle, 3, 2.0)]:
        target, state = wrapped(ctx(per, cur, now=t, config=cfg, state=state))
        out.append(target)
    assert out == expected


def test_bad_kwargs_fail_at_construction():
    with pytest.raises(ValueError, match="no_such_knob"):      # PolicyConfig forbids unknown keys
        EngineAwarePolicy(no_such_knob=1)
    with pytest.raises(ValueError, match="min_replicas"):
        EngineAwarePolicy(min_replicas=5, max_replicas=2)
