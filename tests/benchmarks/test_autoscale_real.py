"""The pure parts of benchmarks/autoscale_real.py (the real-replica autoscaling benchmark): the seeded
trace follows the simulator's load profile, replica-seconds integrate the replicas Serve lists, SLO
attainment and recovery from a synthetic run, the issue's target, the calibrated peak, and each policy's
Serve options through the app's builder (the baseline is Serve's shipped defaults). No Ray cluster."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from ray.serve.config import AutoscalingConfig

from affinity_serve.app.builder import autoscaling_config
from affinity_serve.app.config import AppConfig
from benchmarks.autoscale import BURST, PROFILE, profile
from benchmarks.autoscale_real import (EMULATED_MAX_REPLICAS, EMULATED_PACE, Calibration, Outcome,
                                       decode_capacity, PolicyRun, RealSpec, Sample, Summary, arrival_times,
                                       autoscaling_section, binned, compare, joined_first_requests, joined_stats,
                                       load_trace, peak_rps, policy_role, real_app_config, recovery_s,
                                       replica_seconds, serve_frontier, span, startup_times, summarize)
from benchmarks.routing.workload import FIRST_TOKEN_ID


def _phase_rate(t: np.ndarray, lo: float, hi: float, duration: float) -> float:
    return float(((t >= lo * duration) & (t < hi * duration)).sum() / ((hi - lo) * duration))


def test_arrivals_are_seeded_and_follow_the_profile():
    duration, peak = 2000.0, 20.0
    t = arrival_times(duration, peak, seed=3)
    assert np.array_equal(t, arrival_times(duration, peak, seed=3))
    assert not np.array_equal(t, arrival_times(duration, peak, seed=4))
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < duration
    # every flat phase runs at its profile level (Poisson noise: a few % at these counts)
    flat = [(x0, nxt[0], a) for (x0, a, b), nxt in zip(PROFILE, PROFILE[1:] + [(1.0, 0, 0)]) if a == b]
    assert len(flat) >= 4
    for lo, hi, level in flat:
        assert _phase_rate(t, lo, hi, duration) == pytest.approx(peak * level, rel=0.12), (lo, hi, level)
    # the burst is twice the steady phases around it, the quiet tail a twentieth of the burst
    burst = _phase_rate(t, *BURST, duration)
    assert burst / _phase_rate(t, 0.40, 0.50, duration) == pytest.approx(2.0, rel=0.1)
    assert _phase_rate(t, 0.75, 1.0, duration) / burst == pytest.approx(0.05, rel=0.25)
    # the ramp rises
    assert _phase_rate(t, 0.10, 0.20, duration) < _phase_rate(t, 0.30, 0.40, duration)
    expected = peak * duration * np.mean([profile(x) for x in np.linspace(0, 1, 10_001)])
    assert len(t) == pytest.approx(expected, rel=0.05)


def test_trace_requests_reuse_the_tenants_prompts_at_the_arrival_times():
    spec = RealSpec(duration_s=120.0, seed=1)
    trace = load_trace(spec, vocab_size=1024, peak_rps=6.0)
    assert [r.arrival_s for r in trace] == pytest.approx(arrival_times(120.0, 6.0, 1).tolist())
    assert [r.prompt_token_ids for r in trace] == [r.prompt_token_ids for r in load_trace(spec, 1024, 6.0)]
    heads = {tuple(r.prompt_token_ids[:64]) for r in trace}           # the first 64 tokens: a system prompt's
    tenants = {r.group for r in trace}
    assert len(heads) == len(tenants) <= 8 < len(trace) / 4            # many requests per prefix: caches matter
    assert min(min(r.prompt_token_ids) for r in trace) >= FIRST_TOKEN_ID
    assert all(1 <= len(r.output_token_ids) <= 32 for r in trace)


def _samples(*points: tuple[float, dict[str, int]]) -> list[Sample]:
    return [Sample(t, states, 0, 0.0) for t, states in points]


def test_replica_seconds_integrate_every_listed_replica_over_the_span():
    samples = _samples((0.0, {"RUNNING": 1}), (10.0, {"RUNNING": 1, "STARTING": 2}), (20.0, {"RUNNING": 3}),
                       (30.0, {"RUNNING": 2, "STOPPING": 1}), (35.0, {"RUNNING": 2}))
    # 1 x 10 + 3 x 10 + 3 x 10 + 3 x 5 (stopping replicas still cost) + 2 x 5 (the last sample holds)
    assert replica_seconds(samples, 0.0, 40.0) == pytest.approx(95.0)
    assert replica_seconds(samples, 5.0, 25.0) == pytest.approx(1 * 5 + 3 * 10 + 3 * 5)
    assert replica_seconds(samples, 0.0, 60.0) == pytest.approx(95.0 + 2 * 20)    # beyond the samples: holds
    late = _samples((2.0, {"RUNNING": 2}), (4.0, {"RUNNING": 1}))
    assert replica_seconds(late, 0.0, 6.0) == pytest.approx(2 * 4 + 1 * 2)         # the first covers the start
    assert replica_seconds([], 0.0, 10.0) == 0.0
    assert replica_seconds(samples, 10.0, 10.0) == 0.0


def test_startup_times_pair_starting_replicas_with_later_running_ones():
    samples = _samples((0.0, {"RUNNING": 1}), (10.0, {"RUNNING": 1, "STARTING": 1}),
                       (20.0, {"RUNNING": 1, "STARTING": 2}), (25.0, {"RUNNING": 2, "STARTING": 1}),
                       (40.0, {"RUNNING": 3}), (50.0, {"RUNNING": 1, "STOPPING": 2}),
                       (60.0, {"RUNNING": 1, "STARTING": 1}), (61.0, {"RUNNING": 1}),   # stopped before it ran
                       (70.0, {"RUNNING": 1, "STARTING": 1}), (75.0, {"RUNNING": 2}))
    assert startup_times(samples) == pytest.approx([15.0, 20.0, 5.0])


def _run(policy: str, role: str, rows: list[tuple[float, float | None, bool]],
         samples: list[Sample] | None = None) -> PolicyRun:
    """rows: (arrival, ttft or None for not sent, ok)."""
    outs = []
    for i, (arrival, ttft, ok) in enumerate(rows):
        o = Outcome(f"R{i}", arrival, expected_tokens=4)
        if ttft is not None:
            o.sent_s, o.status, o.first_s, o.end_s = arrival, 200 if ok else 503, arrival + ttft, arrival + ttft + 0.1
            o.num_output_tokens = 4 if ok else 0
        outs.append(o)
    return PolicyRun(policy, role, {}, outs, samples or _samples((0.0, {"RUNNING": 1})))


def test_attainment_counts_failed_and_unsent_requests_as_misses():
    spec = RealSpec(duration_s=100.0, ttft_slo_s=1.0)
    rows = [(float(i), 0.2, True) for i in range(16)] + [(20.0, 3.0, True), (21.0, 0.3, False), (22.0, None, False),
                                                         (23.0, 0.5, True)]
    s = summarize(_run("x", "ours", rows), spec, (0.0, 100.0))
    assert (s.num_requests, s.failed, s.unsent) == (20, 1, 1)
    assert s.ttft_slo_attainment == pytest.approx(17 / 20)      # 3.0 s misses, so do the failed and unsent
    assert s.ttft_p50_s == pytest.approx(0.2)                   # percentiles over answered requests only
    assert s.replica_seconds == pytest.approx(100.0)
    sse = Outcome("E", 0.0, sent_s=0.0, status=200, sse_error=True, first_s=0.1, end_s=0.2, num_output_tokens=4,
                  expected_tokens=4)
    assert not sse.ok and math.isinf(sse.ttft_s)                # an SSE error event fails a 200 stream
    # TPOT: (end - first) / 3 tokens = 0.1 / 3 s for every answered row; failed and unsent miss
    assert s.tpot_slo_attainment == pytest.approx(18 / 20)
    assert s.tpot_p90_s == pytest.approx(0.1 / 3)
    slow = Outcome("S", 0.0, sent_s=0.0, status=200, first_s=0.1, end_s=1.0, num_output_tokens=4, expected_tokens=4)
    assert slow.tpot_s == pytest.approx(0.3)
    one = Outcome("O", 0.0, sent_s=0.0, status=200, first_s=0.1, end_s=0.1, num_output_tokens=1, expected_tokens=1)
    assert math.isnan(one.tpot_s)                               # one token: no TPOT, not counted
    s2 = summarize(PolicyRun("y", "ours", {}, [slow, one], _samples((0.0, {"RUNNING": 1}))),
                   replace(spec, tpot_slo_s=0.2), (0.0, 100.0))
    assert s2.tpot_slo_attainment == 0.0


def test_recovery_runs_from_the_burst_to_the_end_of_the_last_bad_bin_after_it():
    arrivals = np.array([1.0, 2.0, 51.0, 52.0, 61.0, 62.0, 63.0, 71.0, 81.0])
    ttfts = np.array([9.0, 9.0, 0.1, 5.0, 0.1, math.inf, 0.1, 0.1, 0.1])
    bins, rate, att, p90 = binned(arrivals, ttfts, 1.0, 90.0)
    assert bins[0] == 0.0 and bins[1] - bins[0] == 5.0
    assert att[0] == 0.0 and att[10] == 0.5 and att[12] == pytest.approx(2 / 3) and att[14] == 1.0
    assert att[3] == 1.0 and p90[3] == 0.0 and rate[12] == pytest.approx(3 / 5)   # empty bins attain
    # burst at 50: bins [50, 55) and [60, 65) are under 90% -> recovered at 65; the bad bin at 0 is before it
    assert recovery_s(bins, att, 50.0) == pytest.approx(15.0)
    assert recovery_s(bins, [1.0] * len(bins), 50.0) == 0.0


def test_span_is_common_and_covers_the_slowest_policy():
    fast = _run("a", "ours", [(1.0, 0.1, True), (50.0, 0.1, True)])
    slow = _run("b", "baseline", [(1.0, 0.1, True), (50.0, 70.0, True)])
    assert span([fast, slow], 100.0) == (1.0, pytest.approx(120.1))
    assert span([fast], 100.0) == (1.0, 100.0)


def test_target_needs_equal_attainment_20_percent_fewer_replica_seconds_and_no_failures():
    spec = RealSpec(duration_s=100.0)
    base = summarize(_run("serve", "baseline", [(1.0, 0.1, True)] * 9 + [(2.0, 5.0, True)],
                          _samples((0.0, {"RUNNING": 2}))), spec, (0.0, 100.0))
    good = summarize(_run("ours", "ours", [(1.0, 0.1, True)] * 10, _samples((0.0, {"RUNNING": 1}))), spec,
                     (0.0, 100.0))
    assert compare(good, base)["target_met"] and compare(good, base)["replica_seconds_ratio"] == 0.5
    costly = summarize(_run("ours", "ours", [(1.0, 0.1, True)] * 10,
                            _samples((0.0, {"RUNNING": 1}), (10.0, {"RUNNING": 2}))), spec, (0.0, 100.0))
    assert not compare(costly, base)["target_met"]                    # 1.9 / 2: only 5% fewer
    worse = summarize(_run("ours", "ours", [(1.0, 0.1, True)] * 8 + [(2.0, 5.0, True)] * 2,
                           _samples((0.0, {"RUNNING": 1}))), spec, (0.0, 100.0))
    assert not compare(worse, base)["target_met"]                     # 0.8 < 0.9 attainment
    failing = summarize(_run("ours", "ours", [(1.0, 0.1, True)] * 9 + [(1.0, 0.1, False)],
                             _samples((0.0, {"RUNNING": 1}))), spec, (0.0, 100.0))
    assert failing.ttft_slo_attainment == base.ttft_slo_attainment
    assert not compare(failing, base)["target_met"]                   # a failed request fails it


def _row(policy: str, role: str, attainment: float, replica_s: float) -> Summary:
    return Summary(policy, role, 100, attainment, math.nan, math.nan, replica_s, math.nan, math.nan, 0.0, 0, 0, 1,
                   math.nan, (0.0, 100.0))


def test_ours_is_judged_against_the_tuned_rules_frontier_at_ours_attainment():
    tuned = [_row("serve-t2", "sensitivity", 0.99, 800.0), _row("serve-t4", "sensitivity", 0.95, 600.0),
             _row("serve-t8", "sensitivity", 0.90, 650.0)]        # t=8 is dominated by t=4: off the frontier
    f = serve_frontier([_row("engine", "ours", 0.97, 560.0), _row("serve-default", "baseline", 1.0, 2000.0), *tuned])
    assert f["reached"] and f["serve_replica_seconds"] == pytest.approx(700.0)   # halfway from t=4 to t=2
    assert f["ratio"] == pytest.approx(0.8) and f["targets"] == ["serve-t2", "serve-t4", "serve-t8"]
    above = serve_frontier([_row("engine", "ours", 0.995, 700.0), *tuned])
    assert not above["reached"] and above["serve_replica_seconds"] == 800.0        # a bound: its best point
    assert serve_frontier([_row("engine", "ours", 0.9, 1.0), _row("serve-default", "baseline", 1.0, 2.0)]) is None
    assert serve_frontier(tuned) is None
    # a variant row (engine-warmprefix) gets its own ratio, with or without ours' row in the run
    with_variant = serve_frontier([_row("engine", "ours", 0.97, 560.0),
                                   _row("engine-warmprefix", "ours-variant", 0.95, 480.0), *tuned])
    assert with_variant["ratio"] == pytest.approx(0.8)
    assert with_variant["variants"] == [{"policy": "engine-warmprefix", "attainment": 0.95, "replica_seconds": 480.0,
                                         "serve_replica_seconds": 600.0, "reached": True, "ratio": 0.8}]
    alone = serve_frontier([_row("engine-warmprefix", "ours-variant", 0.95, 480.0), *tuned])
    assert "ratio" not in alone and alone["variants"][0]["ratio"] == pytest.approx(0.8)


def test_peak_overloads_one_replica_and_stays_under_two():
    assert peak_rps(10.0, 20.0, 1.5) == pytest.approx(15.0)           # two double: 1.5 x X1
    assert peak_rps(10.0, 16.0, 1.5) == pytest.approx(0.85 * 16.0)    # lowered so that two keep up
    assert peak_rps(10.0, 9.0, 1.5) == pytest.approx(12.0)            # but always over one replica
    assert peak_rps(10.0, 16.0, 4.0, emulate=True) == pytest.approx(40.0)   # emulated: factor x X1 as it is


def test_decode_capacity_is_where_the_tpot_line_crosses_the_slo():
    assert decode_capacity(0.11, 0.17, 8, 0.2) == pytest.approx(20.0)     # 0.11 + 0.0075 (C - 8) = 0.2
    assert decode_capacity(0.25, 0.30, 8, 0.2) == pytest.approx(1.0)      # past the SLO at N already: floor 1
    assert decode_capacity(0.10, 0.10, 8, 0.2) == pytest.approx(32.0)     # no growth measured: 4N


def test_an_emulated_run_paces_every_replica_and_raises_max_replicas():
    spec = RealSpec(emulate=True, max_replicas=EMULATED_MAX_REPLICAS, model="demo")
    _, section = autoscaling_section("serve-default", spec, _cal())
    assert section["max_replicas"] == EMULATED_MAX_REPLICAS
    cfg = real_app_config(spec, "/m", section)
    parsed = AppConfig.model_validate(cfg)
    assert parsed.engine.pace.enabled and parsed.engine.pace.step_base_s == EMULATED_PACE["step_base_s"]
    assert parsed.autoscaling.max_replicas == EMULATED_MAX_REPLICAS
    assert not AppConfig.model_validate(real_app_config(RealSpec(), "/m", section)).engine.pace.enabled


def _cal() -> Calibration:
    return Calibration(0.1, 0.2, 800.0, 8.0, 13.0, 8, 40.0, 0.4, 13.3, 0.2, 12.0, "measured")


def test_the_baseline_is_serves_shipped_defaults_through_the_builder():
    role, section = autoscaling_section("serve-default", RealSpec(), _cal())
    ac = AutoscalingConfig(**autoscaling_config(AppConfig.model_validate(
        {"engine": {"model": "/m"}, "autoscaling": section})))
    shipped = AutoscalingConfig()
    assert role == "baseline"
    for name in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                 "metrics_interval_s"):
        assert getattr(ac, name) == getattr(shipped, name), name
    assert ac.policy.policy_function == shipped.policy.policy_function      # Serve's own rule
    assert (ac.min_replicas, ac.max_replicas, ac.initial_replicas) == (1, 3, 1)


def test_ours_runs_with_the_calibration_and_the_apps_delays():
    spec = RealSpec(ttft_slo_s=0.8)
    role, section = autoscaling_section("engine", spec, _cal())
    cfg = AppConfig.model_validate({"engine": {"model": "/m"}, "autoscaling": section})
    kwargs = autoscaling_config(cfg)["policy"]["policy_kwargs"]
    app = AppConfig().autoscaling
    assert role == "ours"
    assert (kwargs["prefill_tokens_per_s"], kwargs["decode_seqs_per_replica"], kwargs["ttft_slo_s"]) == (800.0, 13.3,
                                                                                                         0.8)
    assert (kwargs["upscale_delay_s"], kwargs["downscale_delay_s"]) == (app.upscale_delay_s, app.downscale_delay_s)
    assert (cfg.autoscaling.look_back_period_s, cfg.autoscaling.metrics_interval_s) == (app.look_back_period_s,
                                                                                        app.metrics_interval_s)
    assert autoscaling_section("serve-t8", spec, _cal())[1]["target_ongoing_requests"] == 8.0
    with pytest.raises(ValueError):
        policy_role("serve-tx")


def test_the_no_warmup_variant_is_ours_with_the_routers_warm_up_on_join_off():
    spec, cal = RealSpec(), _cal()
    role, section = autoscaling_section("engine-nowarm", spec, cal)
    assert role == "ours-variant" and section == autoscaling_section("engine", spec, cal)[1]
    assert real_app_config(spec, "/m", section, warmup_on_join=False)["routing"]["warmup_on_join"] is False
    on = AppConfig.model_validate(real_app_config(spec, "/m", section))
    assert on.routing.warmup_on_join is True
    off = AppConfig.model_validate(real_app_config(spec, "/m", section, warmup_on_join=False))
    assert off.routing.warmup_on_join is False


def test_a_joining_replicas_first_requests_are_told_apart_from_the_rest():
    """Replica a answered first (up before the trace); b joined at 30 s and c at 50 s. Within 20 s of its
    first request each joined replica's requests count as its first ones; unanswered requests count nowhere."""
    def o(t: float, rid: str, first: float | None = 0.2, cached: int = 0) -> Outcome:
        out = Outcome(f"r{t}", t, sent_s=t, status=200, first_s=None if first is None else t + first,
                      end_s=t + 1, num_output_tokens=4, expected_tokens=4, num_prompt_tokens=100,
                      num_cached_tokens=cached, replica_id=rid)
        return out
    outs = [o(1, "a", cached=90), o(2, "a", cached=90), o(30, "b", 0.9, 0), o(40, "b", 1.5, 50),
            o(49.9, "b", 0.3, 90), o(50, "b", 0.2, 90), o(50, "c", 0.7, 0), o(60, "a", cached=90),
            o(55, "", None)]
    early, rest = joined_first_requests(outs)
    assert sorted((x.replica_id, x.sent_s) for x in early) == [("b", 30), ("b", 40), ("b", 49.9), ("c", 50)]
    assert sorted((x.replica_id, x.sent_s) for x in rest) == [("a", 1), ("a", 2), ("a", 60), ("b", 50)]
    st = joined_stats(early, slo_s=1.0)
    assert st["n"] == 4 and st["hit_rate"] == pytest.approx(140 / 400)
    assert st["ttft_slo_attainment"] == pytest.approx(3 / 4)             # the 1.5 s one missed
    assert st["ttft_p50_s"] == pytest.approx(0.8)
    assert joined_stats([], 1.0) == {"n": 0}
    assert joined_first_requests(outs[:2]) == ([], outs[:2])            # one replica throughout: nothing joined


def test_the_controller_log_lines_kept_are_serves_scaling_lines_and_our_acting_decisions():
    from benchmarks.autoscale_real import _DECISION_LINE, _SCALING_LINE
    head = "INFO 2026-11-25 14:00:01,250 controller 4242 -- "
    serve = head + "Upscaling Deployment(name='LLMReplica', app='affinity') from 1 to 2 replicas. Current ongoing"
    from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, decide
    from affinity_serve.autoscale.signals import ReplicaSignals
    d = decide([ReplicaSignals(num_running=30, prefill_tokens_per_s=1500, num_recent_requests=5)], 1, 0.0,
               PolicyState(), PolicyConfig(max_replicas=4, upscale_delay_s=0.0))
    ours = head + "affinity/LLMReplica: " + d.describe()            # as EngineAwarePolicy logs it
    m = _SCALING_LINE.match(serve)
    assert m and (m[2], m[3].split()[:4]) == ("Upscaling", ["from", "1", "to", "2"])
    m = _DECISION_LINE.match(ours)
    assert m and m[2] == "up_predicted" and m[3].startswith(f"-> {d.target_replicas} (load ") and "refills" in m[3]
    assert _DECISION_LINE.match(head + "affinity/Ingress: up_predicted -> 2") is None
    assert _DECISION_LINE.match(head + "affinity/LLMReplica: hold -> 2 (load 0.1)") is None     # no action
    assert _DECISION_LINE.match(head + "affinity/LLMReplica: up_pending -> 2 (load 0.1)") is None


@pytest.mark.parametrize("policy,keys", [("engine-warmprefix", {"warm_prefix_headroom": True})])
def test_the_round_5_variant_is_ours_with_its_option_flipped(policy, keys):
    spec, cal = RealSpec(), _cal()
    role, section = autoscaling_section(policy, spec, cal)
    assert role == "ours-variant"
    assert section == autoscaling_section("engine", spec, cal)[1] | keys
    autoscaling = AppConfig.model_validate(real_app_config(spec, "/m", section)).autoscaling
    assert {k: getattr(autoscaling, k) for k in keys} == keys
