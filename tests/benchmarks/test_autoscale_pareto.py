"""benchmarks/autoscale_pareto.py's pieces: the shifting-mix traces, Serve's Pareto frontier and its
interpolation, the Dynamo-style planner baseline's sizing, and the clairvoyant schedule."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.autoscale import DynamoPlannerPolicy
from benchmarks.autoscale_pareto import (MIX_SPEC, MIX_WORKLOADS, SHIFT_AT, ClairvoyantPolicy, cost_at, frontier,
                                         future_load, mix_trace, request_work)
from benchmarks.routing.replica import TimingModel
from benchmarks.routing.workload import Trace, TraceMeta, TraceRequest, WorkloadSpec


def _halves(trace, key):
    T = trace.meta.duration_s
    early = [key(r) for r in trace.requests if r.arrival_s < SHIFT_AT * T]
    late = [key(r) for r in trace.requests if r.arrival_s >= SHIFT_AT * T]
    return float(np.median(early)), float(np.median(late))


@pytest.mark.parametrize("kind", MIX_WORKLOADS)
def test_mix_traces_are_seeded_and_sorted(kind):
    a, b = mix_trace(kind, 2, 60.0, 0.5, seed=3), mix_trace(kind, 2, 60.0, 0.5, seed=3)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    assert all(len(r.prompt_token_ids) + len(r.output_token_ids) <= MIX_SPEC.max_model_len for r in a.requests)
    assert mix_trace(kind, 2, 60.0, 0.5, seed=4).requests[0].prompt_token_ids != a.requests[0].prompt_token_ids


def test_the_mix_shifts_where_each_workload_says():
    out = _halves(mix_trace("output-shift", 4, 120.0, 0.5, 0), lambda r: len(r.output_token_ids))
    assert out[1] / out[0] == pytest.approx(4.0, rel=0.25)
    prompt = _halves(mix_trace("prompt-shift", 4, 120.0, 0.5, 0), lambda r: len(r.prompt_token_ids))
    assert prompt[0] == pytest.approx(500, rel=0.25) and prompt[1] == pytest.approx(8000, rel=0.15)
    shared = _halves(mix_trace("reuse-collapse", 4, 120.0, 0.5, 0), lambda r: float(bool(r.group)))
    assert shared == (1.0, 0.0)
    d = mix_trace("diurnal", 4, 200.0, 0.5, 0)
    counts = np.histogram([r.arrival_s for r in d.requests], bins=4, range=(0, 200))[0]
    assert counts[1] > 2 * counts[0] and counts[2] > 2 * counts[3]        # up in the middle of the day
    with pytest.raises(ValueError, match="unknown workload"):
        mix_trace("nope", 2, 10.0, 0.5, 0)


def test_the_frontier_keeps_the_non_dominated_points_and_interpolates_between_them():
    pts = [(100, 0.70), (150, 0.95), (120, 0.60), (200, 0.99), (300, 0.98)]
    assert frontier(pts) == [(100, 0.70), (150, 0.95), (200, 0.99)]
    assert cost_at(pts, 0.5) == (100, True)                    # the cheapest point already does better
    assert cost_at(pts, 0.97) == (pytest.approx(175.0), True)  # halfway from 0.95 to 0.99
    assert cost_at(pts, 0.995) == (200, False)                 # never reached: its best point, flagged


def test_the_planner_sizes_from_arrivals_and_profiled_throughput_without_latency_feedback():
    timing = TimingModel()
    p = DynamoPlannerPolicy(timing, MIX_SPEC, tpot_slo_s=0.15, min_replicas=1, max_replicas=64, utilization=0.8,
                            interval_s=10.0)
    for i in range(100):                                         # 10 req/s of 2000-token prompts
        p.on_arrival(i * 0.1, 2000)
        p.on_finish(i * 0.1, 2000, 200)
    target = p([], 0.0, 1, 10.0)
    prefill = 10 * 2000 * timing.prefill_per_token_s             # 1 replica of prefill
    decode = 10 * 200 / p.decode_tokens_per_s(2000, 200)
    assert target == math.ceil((prefill + decode) / 0.8)
    # a latency breach changes nothing: the planner reads no latency; it re-plans once per interval
    assert p([], 0.0, target, 15.0) == target
    assert p([], 0.0, target, 20.0) == 1                         # nothing arrived in the last interval


def _trace(reqs: list[tuple[float, list[int], int]], duration_s: float) -> Trace:
    rs = [TraceRequest(f"r{i}", t, "D", "", prompt, [7] * out) for i, (t, prompt, out) in enumerate(reqs)]
    meta = TraceMeta(WorkloadSpec(num_replicas=1, seed=0), MIX_SPEC, saturation_rps_per_replica=1.0,
                     arrival_rate_rps=1.0, duration_s=duration_s, warmup_s=0.0, num_tenants=1, think_mean_s=0.0,
                     measured_pressure=0.0, measured_load=0.5, num_requests=len(rs))
    return Trace(meta, rs)


def test_the_future_load_spreads_each_requests_work_over_its_life_and_credits_a_prefix_sent_before():
    timing = TimingModel()
    shared = list(range(1000, 1000 + 1600))                       # 100 blocks
    trace = _trace([(1.0, shared + [5] * 400, 50), (2.0, shared + [6] * 400, 50)], 10.0)
    load = future_load(trace, timing, MIX_SPEC, grid_s=0.5)
    first, _ = request_work(2000, 2000, 50, timing, MIX_SPEC)
    second, life = request_work(2000, 400, 50, timing, MIX_SPEC)   # the shared 1600 tokens are cached
    assert load.sum() * 0.5 == pytest.approx(first + second)
    assert second < first
    assert load[:2].sum() == 0.0                                  # nothing before the first arrival
    assert life == pytest.approx(400 * timing.prefill_per_token_s + 50 * 0.05)


def test_the_clairvoyant_schedule_asks_one_start_up_ahead_and_lets_go_when_no_load_is_coming():
    timing = TimingModel()
    prompt = list(range(3, 3 + 4000))
    # 40 requests/s of unique 4k prompts from t=60 to t=90: many replicas of prefill
    reqs = [(60.0 + i / 40, [10000 + i] + prompt[1:], 20) for i in range(1200)]    # unique chains
    pol = ClairvoyantPolicy(_trace(reqs, 150.0), timing, MIX_SPEC, startup_s=10.0, min_replicas=1, max_replicas=64,
                            utilization=0.8)
    need = math.ceil(40 * request_work(4000, 4000, 20, timing, MIX_SPEC)[0] / 0.8)
    assert pol([], 0.0, 1, 40.0) == 1                             # the load is more than a start-up away
    assert pol([], 0.0, 1, 50.0) >= need                          # a start-up ahead: ready when it comes
    assert pol([], 0.0, need, 75.0) >= need
    assert pol([], 0.0, need, 110.0) == 1                         # nothing coming within a start-up
    assert pol.decisions[0] == (50.0, pol([], 0.0, 1, 50.0), "clairvoyant")
