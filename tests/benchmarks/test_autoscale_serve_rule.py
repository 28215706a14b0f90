"""benchmarks/autoscale.py's re-implementation of Ray Serve's default policy decides exactly what Serve's own
code decides (replica_queue_length_autoscaling_policy wrapped by _apply_autoscaling_config, then the min/max
bounds the controller applies), tick by tick over a seeded load sequence with ramps, bursts and lulls, at
Serve's shipped defaults and at a tuned setting. The benchmark's baseline is only honest if this holds."""
from __future__ import annotations

import numpy as np
import pytest
import ray.serve.autoscaling_policy as serve_policy
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config, replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from benchmarks.autoscale import SERVE_DEFAULTS, RayDefaultPolicy

DEP = DeploymentID(name="LLMReplica", app_name="affinity")


class _Clock:
    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _load(seed: int, steps: int) -> np.ndarray:
    """Ongoing requests per tick: a noisy ramp, a burst, a lull to zero and back."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, steps)
    base = np.where(x < 0.3, 40 * x, np.where(x < 0.5, 30.0, np.where(x < 0.6, 0.0, 12.0)))
    return np.maximum(0.0, base + rng.normal(0, 3, steps))


@pytest.mark.parametrize("setting", [
    dict(SERVE_DEFAULTS),                                               # target 2, up 30 s, down 600 s
    dict(target_ongoing_requests=8.0, upscale_delay_s=2.0, downscale_delay_s=30.0, look_back_period_s=5.0,
         metrics_interval_s=1.0),
])
def test_the_benchmarks_serve_rule_matches_serves_code(setting, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_policy, "time", clock)          # Serve's delay timers read time.time()
    lo, hi = 1, 16
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, **setting)
    serve = _apply_autoscaling_config(replica_queue_length_autoscaling_policy)
    ours = RayDefaultPolicy(setting["target_ongoing_requests"], lo, hi, setting["upscale_delay_s"],
                            setting["downscale_delay_s"], setting["look_back_period_s"],
                            setting["metrics_interval_s"], "serve", "baseline")
    n, state, moves = 1, {}, 0
    tick = 0.5
    for i, total in enumerate(_load(7, 6000)):                 # 3000 s of ticks
        clock.now = 1000.0 + i * tick
        ctx = AutoscalingContext(
            deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name, current_num_replicas=n,
            target_num_replicas=n, running_replicas=[], total_num_requests=float(total), total_queued_requests=0.0,
            aggregated_metrics={}, raw_metrics={}, capacity_adjusted_min_replicas=lo,
            capacity_adjusted_max_replicas=hi, policy_state=state, last_scale_up_time=None,
            last_scale_down_time=None, current_time=clock.now, config=config)
        want, state = serve(ctx)
        want = max(lo, min(hi, int(want)))                   # the controller's bounds
        got = ours.decide(float(total), n, clock.now)
        assert got == want, (i, clock.now, total, n)
        moves += want != n
        n = want
    assert moves >= 3                                          # the sequence did exercise both directions
