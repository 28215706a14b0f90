"""EngineAwarePolicy: the adapter from Ray Serve's custom autoscaling policy hook to `policy.decide`.

Serve instantiates the class once in its controller (`AutoscalingPolicy(policy_function=
"affinity_serve.autoscale.serve_policy:EngineAwarePolicy", policy_kwargs={...})`, the kwargs being `PolicyConfig`'s
fields as JSON, as Serve requires) and calls it about every 0.1 s with an `AutoscalingContext`; it returns (target,
policy_state).
The replicas' `record_autoscaling_stats()` dicts (autoscale.signals.METRIC_KEYS) arrive averaged over
`look_back_period_s` in `ctx.aggregated_metrics[key][replica_id]`.

Serve wraps every custom policy with its own scaling factors, up/down delays and min/max bounds; the
builder sets Serve's delays to 0 so the hysteresis here is the only one (docs/autoscaling.md).

Each decision is also exported (`DecisionMetrics`): the app's `/metrics` shows every deployment's latest target,
current count, up/down targets and load, and the decisions by reason (docs/observability.md).
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, ScalingDecision, decide
from affinity_serve.autoscale.signals import METRIC_KEYS, ReplicaSignals
from affinity_serve.observability.aggregate import Snapshot, snapshot_of
from affinity_serve.observability.metrics import AutoscalerMetrics, AutoscaleSample

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


#: a deployment's decision series stop being pushed this long after its policy was last called (the deployment
#: was deleted, or redeployed with a new policy object): the hub then drops its gauges after its GAUGE_TTL_S
DECISIONS_STALE_AFTER_S = 5.0


def _in_ray_actor() -> bool:
    """True in a Ray actor (Serve's controller), where there is a hub to push to; False in a plain process (a
    unit test calling the policy), which must not start Ray by asking for the hub."""
    try:
        import ray
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


class DecisionMetrics:
    """One deployment's decisions as metrics (observability/metrics.py `AutoscalerMetrics`) on a private meter.
    With `push`, a `MetricsExporter` thread collects it and pushes the snapshot to the app's metrics hub every
    second while the policy is being called: the policy's tick only stores the decision and adds one count, and
    never waits on the hub (a missing hub is retried on that thread)."""

    def __init__(self, app_name: str, deployment: str, push: bool):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        self.deployment = deployment
        self.reader = InMemoryMetricReader()
        self._provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.metrics = AutoscalerMetrics(self._provider.get_meter("affinity-serve.autoscale"))
        self._last_call = time.monotonic()
        self.exporter: Any = None
        if push:
            from affinity_serve.app.metrics_hub import MetricsExporter
            # only looks the app's hub up: its own processes create it, so a push after the app was deleted
            # cannot bring back a hub killed since
            self.exporter = MetricsExporter(self.reader, app_name, f"autoscaler:{deployment}", active=self.active,
                                            creates_hub=False)

    def record(self, d: ScalingDecision, current_replicas: int) -> None:
        ld = d.load
        self.metrics.record(self.deployment, AutoscaleSample(
            reason=d.reason.value, target_replicas=d.target_replicas, current_replicas=current_replicas,
            up_target=d.up_target, down_target=d.down_target, load_units=ld.load_units,
            prefill_units=ld.prefill_units, decode_units=ld.decode_units, kv_units=ld.kv_units,
            trend_units=ld.trend_units))
        self._last_call = time.monotonic()

    def active(self) -> bool:
        return time.monotonic() - self._last_call <= DECISIONS_STALE_AFTER_S

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.reader.get_metrics_data())

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


class EngineAwarePolicy:
    """Keeps the policy's hysteresis state between ticks; logs each change of decision reason."""

    def __init__(self, **policy_kwargs: Any):
        # Serve hands over the JSON the builder dumped (builder.engine_policy_kwargs): validated back here
        self.config = PolicyConfig.model_validate(policy_kwargs)
        self.state = PolicyState()
        self.last: ScalingDecision | None = None
        #: made at the first call of a Serve app's policy (ctx.app_name); None outside one, or if it failed
        self.decision_metrics: DecisionMetrics | None = None
        self._metrics_failed = False

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
        self._export(ctx, d)
        return d.target_replicas, {"reason": d.reason.value, "load_units": round(d.load.load_units, 3),
                                   "up_target": d.up_target, "down_target": d.down_target}


    def _export(self, ctx: Any, d: ScalingDecision) -> None:
        """Hand the decision to the metrics; never fails the policy (a failure turns the export off, logged once)."""
        if self._metrics_failed or not getattr(ctx, "app_name", None):
            return
        try:
            if self.decision_metrics is None:
                self.decision_metrics = DecisionMetrics(ctx.app_name, ctx.deployment_name, push=_in_ray_actor())
                weakref.finalize(self, self.decision_metrics.close)     # Serve dropped this policy: stop its thread
            self.decision_metrics.record(d, int(ctx.current_num_replicas))
        except Exception:
            self._metrics_failed = True
            logger.warning("%s/%s: autoscaling decisions are not exported to /metrics", ctx.app_name,
                           ctx.deployment_name, exc_info=True)


_ACTS = {Reason.COLD_START, Reason.UP_PREDICTED, Reason.UP_SLO, Reason.DOWN, Reason.TO_ZERO}
