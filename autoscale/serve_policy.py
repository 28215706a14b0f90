"""EngineAwarePolicy: the adapter from Ray Serve's custom autoscaling policy hook to `policy.decide`.

Serve instantiates the class once in its controller (`AutoscalingPolicy(policy_function=
"affinity_serve.autoscale.serve_policy:EngineAwarePolicy", policy_kwargs={...})`, the kwargs being `PolicyConfig`'s
fields as JSON, as Serve requires) and calls it about every 0.1 s with an `AutoscalingContext`; it returns (target,
policy_state).
The replicas' `record_autoscaling_stats()` dicts (autoscale.signals.METRIC_KEYS) arrive averaged over
`look_back_period_s` in `ctx.aggregated_metrics[key][replica_id]`.

Serve wraps every custom policy with its own scaling factors, up/down delays and min/max bounds; the
builder sets Serve's delays to 0 so the hysteresis here is the only one (docs/autoscaling.md).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, ScalingDecision, decide
from affinity_serve.autoscale.signals import METRIC_KEYS, ReplicaSignals

# A child of Serve's own logger: in the controller, Serve's handlers (logs/serve/controller_*.log, at INFO)
# write our decisions next to its "Upscaling ..." lines; a logger outside "ray.serve" reached no handler there.
logger = logging.getLogger("ray.serve.affinity.autoscale")


def signals_from_context(ctx: Any) -> list[ReplicaSignals]:
    """One ReplicaSignals per running replica that has reported (Serve's aggregated metrics)."""
    agg = ctx.aggregated_metrics or {}
    running = set(ctx.running_replicas or ())
    per: dict[Any, dict[str, float]] = {}
    for key in METRIC_KEYS:
        for rid, value in (agg.get(key) or {}).items():
            if rid in running and value is not None:
                per.setdefault(rid, {})[key] = float(value)
    return [ReplicaSignals.from_metrics(m) for _, m in sorted(per.items(), key=lambda kv: str(kv[0]))]


class EngineAwarePolicy:
    """Keeps the policy's hysteresis state between ticks; logs each change of decision reason."""

    def __init__(self, **policy_kwargs: Any):
        # Serve hands over the JSON the builder dumped (builder.engine_policy_kwargs): validated back here
        self.config = PolicyConfig.model_validate(policy_kwargs)
        self.state = PolicyState()
        self.last: ScalingDecision | None = None

    def decision_inputs(self, ctx: Any) -> tuple[list[ReplicaSignals], float]:
        """What `decide` reads from the context: the replicas' signals and the requests queued at callers
        (a P/D pool's policy, autoscale/pools.py, gives its own view of them)."""
        return signals_from_context(ctx), float(ctx.total_queued_requests or 0.0)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if getattr(ctx, "current_time", None) is not None else time.time()
        # Serve compares our answer with the count it is heading to (target_num_replicas), and replicas
        # still starting count there: decide against that count so a pending scale-up is not repeated.
        current = int(max(ctx.current_num_replicas, ctx.target_num_replicas))
        signals, queued = self.decision_inputs(ctx)
        d = decide(signals, current, now, self.state, self.config, num_queued_at_callers=queued)
        self.state = d.state
        if self.last is None or d.reason != self.last.reason or d.target_replicas != self.last.target_replicas:
            level = logging.INFO if d.reason in _ACTS else logging.DEBUG
            logger.log(level, "%s/%s: %s", ctx.app_name, ctx.deployment_name, d.describe())
        self.last = d
        return d.target_replicas, {"reason": d.reason.value, "load_units": round(d.load.load_units, 3),
                                   "up_target": d.up_target, "down_target": d.down_target}


_ACTS = {Reason.COLD_START, Reason.UP_PREDICTED, Reason.UP_SLO, Reason.DOWN, Reason.TO_ZERO}
