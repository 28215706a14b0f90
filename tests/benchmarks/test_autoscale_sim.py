"""benchmarks/autoscale.py's simulator with a per-replica cap (`--max-ongoing`, Serve's max_ongoing_requests):
a replica never holds more than the cap, the rest wait at the caller first come first served and reach the
policy as queued at callers, and every request still finishes."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.autoscale import AutoscaleSim, SimConfig
from benchmarks.routing.replica import ReplicaSpec, TimingModel
from benchmarks.routing.workload import Trace, TraceMeta, TraceRequest, WorkloadSpec


class _Fixed:
    """A policy that keeps the count and records what it was told."""

    name, role, look_back_s, metrics_interval_s = "fixed", "ours", 5.0, 1.0

    def __init__(self):
        self.decisions: list = []
        self.queued: list[float] = []
        self.ongoing: list[float] = []

    def __call__(self, signals, total_ongoing, current, now, queued=0.0):
        self.queued.append(queued)
        self.ongoing.append(total_ongoing)
        return current


def _trace(n: int) -> Trace:
    rng = np.random.default_rng(0)
    reqs = [TraceRequest(f"q{i}", 0.01 * i, "D", "", rng.integers(10, 30000, 64).tolist(),
                         list(range(1, int(rng.integers(2, 40)))))
            for i in range(n)]
    spec = ReplicaSpec()
    meta = TraceMeta(WorkloadSpec(), spec, saturation_rps_per_replica=1.0, arrival_rate_rps=100.0, duration_s=10.0,
                     warmup_s=0.0, num_tenants=0, think_mean_s=0.0, measured_pressure=0.0, measured_load=0.0,
                     num_requests=n)
    return Trace(meta, reqs)


def _run(cap: int, n: int = 40):
    trace, pol = _trace(n), _Fixed()
    sim = AutoscaleSim(trace, pol, SimConfig(min_replicas=2, max_replicas=2, max_ongoing=cap), ReplicaSpec(),
                       TimingModel(), seed=0)
    peak = [0]
    dispatch = sim.dispatch

    def counted(i: int) -> None:
        dispatch(i)
        peak[0] = max(peak[0], *(r.ongoing for r in sim.reps))
    sim.dispatch = counted
    res = sim.run()
    return sim, pol, res, peak[0]


def test_a_capped_replica_holds_at_most_the_cap_and_the_rest_wait_at_the_caller_in_order():
    sim, pol, res, peak = _run(cap=4)
    assert peak == 4                                   # both replicas full, never over
    assert res.failed == 0 and not np.isnan(sim.finish).any()
    assert max(pol.queued) > 0                         # the policy saw the callers' queue ...
    assert max(pol.ongoing) >= max(pol.queued)         # ... and Serve's rule counts it as ongoing
    # first come first served at the caller: a later request never starts before an earlier one that waited
    dispatched = np.argsort(sim.first, kind="stable")
    waited = [i for i in dispatched if i >= 8]         # the first 8 fit at once
    assert waited == sorted(waited)


def test_without_a_cap_every_request_is_routed_at_once():
    sim, pol, res, peak = _run(cap=0)
    assert peak > 4 and max(pol.queued) == 0 and res.failed == 0


@pytest.mark.parametrize("cap", [1, 3])
def test_every_request_finishes_whatever_the_cap(cap):
    sim, _, res, peak = _run(cap, n=30)
    assert peak <= cap and res.failed == 0 and not np.isnan(sim.finish).any()


@pytest.mark.parametrize("args,message", [
    (["--max-ongoing", "-1"], "--max-ongoing must be >= 0"),
    (["--look-back", "1", "--metrics-interval", "1"], "need 0 < --metrics-interval < --look-back"),
    (["--metrics-interval", "0"], "need 0 < --metrics-interval < --look-back"),
])
def test_the_cli_rejects_settings_serve_would_not_take_with_a_usage_error(args, message):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "benchmarks.autoscale", *args], capture_output=True, text=True,
                       cwd=root, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-500:]
