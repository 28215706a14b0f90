"""The scaling rule (autoscale/policy.py): tables of signals -> decisions, delays, hysteresis, bounds."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, decide, fleet_load, replicas_needed
from affinity_serve.autoscale.signals import ReplicaSignals as S

# 1000 uncached prompt tokens/s and 10 decoding sequences fill one replica; TTFT SLO 1 s, TPOT 0.1 s
CFG = PolicyConfig(min_replicas=1, max_replicas=8, ttft_slo_s=1.0, tpot_slo_s=0.1, prefill_tokens_per_s=1000,
                   decode_seqs_per_replica=10, kv_usage_target=0.85, target_utilization=0.8,
                   downscale_utilization=0.5, upscale_delay_s=0.0, downscale_delay_s=10.0,
                   downscale_to_zero_delay_s=20.0, slo_cooldown_s=5.0, preemption_rate_threshold=0.1,
                   preemption_persist_s=5.0, headroom_z=0.0, trend_lead_s=0.0)
NOW = 1000.0
FRESH = PolicyState()
LONG_DOWN = PolicyState(down_since=NOW - 60)        # a down condition that has held past its delay
PREEMPTING = PolicyState(preempt_since=NOW - 6)     # preemptions above the threshold for 6 s (> 5 s)
IDLE = S()
OK_LATENCY = dict(ttft_p90_s=0.3, tpot_p90_s=0.03, num_recent_requests=20)


def busy(running: float = 0, waiting: float = 0, queued_tokens: float = 0, rate: float = 0, kv: float = 0.1,
         **kw) -> S:
    return S(num_running=running, num_waiting=waiting, num_in_flight=running + waiting,
             num_queued_prefill_tokens=queued_tokens, prefill_tokens_per_s=rate, kv_cache_usage=kv,
             **{**OK_LATENCY, **kw})


CASES = [
    # id, signals, current, state, config overrides, queued at callers, expected target, expected reason
    ("prefill backlog predicts 4", [busy(1, 5, queued_tokens=3000)], 1, FRESH, {}, 0, 4, Reason.UP_PREDICTED),
    ("prefill rate predicts 3", [busy(2, rate=900), busy(2, rate=900)], 2, FRESH, {}, 0, 3, Reason.UP_PREDICTED),
    ("decode load predicts 3", [busy(9), busy(9)], 2, FRESH, {}, 0, 3, Reason.UP_PREDICTED),
    ("KV usage floor", [busy(1, kv=0.95), busy(1, kv=0.95)], 2, FRESH, {}, 0, 3, Reason.UP_PREDICTED),
    ("inside the band: hold", [busy(6), busy(6)], 2, FRESH, {}, 0, 2, Reason.HOLD),
    ("TTFT breach doubles at most", [busy(1, ttft_p90_s=3.0)] * 2, 2, FRESH, {}, 0, 4, Reason.UP_SLO),
    ("TPOT breach x1.5", [busy(1, tpot_p90_s=0.15)] * 4, 4, FRESH, {}, 0, 6, Reason.UP_SLO),
    # the reactive step scales the replicas that report (the latencies are theirs), not the count asked for
    ("one of 2 reporting, TTFT x3: 2 already asked for", [busy(1, ttft_p90_s=3.0)], 2, FRESH, {}, 0, 2,
     Reason.HOLD),
    ("2 of 3 reporting, TTFT x3: 4", [busy(1, ttft_p90_s=3.0)] * 2, 3, FRESH, {}, 0, 4, Reason.UP_SLO),
    ("a replica came up 2 s ago: no reactive step", [busy(1, ttft_p90_s=3.0)] * 2, 2,
     PolicyState(num_reporting=1, ready_time=NOW - 2), {}, 0, 2, Reason.HOLD),
    ("a replica comes up now: no reactive step", [busy(1, ttft_p90_s=3.0)] * 2, 2, PolicyState(num_reporting=1),
     {}, 0, 2, Reason.HOLD),
    ("the last replica came up slo_cooldown_s ago: reactive step", [busy(1, ttft_p90_s=3.0)] * 2, 2,
     PolicyState(num_reporting=2, ready_time=NOW - 6), {}, 0, 4, Reason.UP_SLO),
    ("persistent preemptions: one more", [busy(2, preemptions_per_s=0.5)], 1, PREEMPTING, {}, 0, 2, Reason.UP_SLO),
    ("persistent preemptions: one more, not a factor", [busy(2, preemptions_per_s=0.5)] * 6, 6, PREEMPTING, {}, 0,
     7, Reason.UP_SLO),
    ("preemptions and a TTFT breach: the breach's factor", [busy(2, preemptions_per_s=0.5, ttft_p90_s=1.5)] * 4, 4,
     PREEMPTING, {}, 0, 6, Reason.UP_SLO),
    ("preemptions not persisted yet: hold", [busy(2, preemptions_per_s=0.5)], 1, FRESH, {}, 0, 1, Reason.HOLD),
    ("preemptions under 0.1/s per replica: hold", [busy(6, preemptions_per_s=0.09)] * 2, 2, PREEMPTING, {}, 0, 2,
     Reason.HOLD),
    ("threshold is per replica: 0.3/s over 4 replicas is no breach", [busy(6, preemptions_per_s=0.075)] * 4, 4,
     PREEMPTING, {}, 0, 4, Reason.HOLD),
    ("threshold 0 and no persistence: any preemption", [busy(2, preemptions_per_s=0.01)], 1, FRESH,
     {"preemption_rate_threshold": 0.0, "preemption_persist_s": 0.0}, 0, 2, Reason.UP_SLO),
    ("SLO breach in cooldown: no reactive step", [busy(1, ttft_p90_s=3.0)], 2,
     PolicyState(last_up_time=NOW - 1), {}, 0, 2, Reason.HOLD),
    ("capped at max_replicas", [busy(10, queued_tokens=50_000)], 2, FRESH, {}, 0, 8, Reason.UP_PREDICTED),
    ("already at max: hold", [busy(10, queued_tokens=50_000)], 8, FRESH, {}, 0, 8, Reason.HOLD),
    ("idle fleet, delay held: down to min", [IDLE, IDLE, IDLE], 3, LONG_DOWN, {}, 0, 1, Reason.DOWN),
    ("idle fleet, delay running: pending", [IDLE, IDLE, IDLE], 3, FRESH, {}, 0, 3, Reason.DOWN_PENDING),
    ("light load, delay held: down to what fits at 0.5", [busy(4)] * 4, 4, LONG_DOWN, {}, 0, 4, Reason.HOLD),
    ("lighter load, delay held: down to 2", [busy(2)] * 4, 4, LONG_DOWN, {}, 0, 2, Reason.DOWN),
    ("no down while the SLO is breached", [busy(0, ttft_p90_s=2.0)] * 3, 3,
     replace(LONG_DOWN, last_up_time=NOW - 1), {}, 0, 3, Reason.HOLD),
    ("no down while callers queue", [IDLE, IDLE], 2, LONG_DOWN, {}, 1, 2, Reason.HOLD),
    ("to zero after the idle delay", [IDLE], 1, PolicyState(idle_since=NOW - 30), {"min_replicas": 0}, 0, 0,
     Reason.TO_ZERO),
    ("to zero waits for the idle delay", [IDLE], 1, PolicyState(idle_since=NOW - 5), {"min_replicas": 0}, 0, 1,
     Reason.TO_ZERO_PENDING),
    ("never to zero with min_replicas 1", [IDLE], 1, PolicyState(idle_since=NOW - 999), {}, 0, 1, Reason.HOLD),
    ("cold start sized by the queue", [], 0, FRESH, {"min_replicas": 0}, 25, 4, Reason.COLD_START),
    ("cold start: at least one", [], 0, FRESH, {"min_replicas": 0}, 1, 1, Reason.COLD_START),
    ("zero and nothing waiting: stay at zero", [], 0, FRESH, {"min_replicas": 0}, 0, 0, Reason.HOLD),
    ("no replica reported yet: hold", [], 2, FRESH, {}, 0, 2, Reason.NO_METRICS),
    ("above max_replicas: back to the bound", [IDLE], 9, FRESH, {}, 0, 8, Reason.BOUNDS),
]


@pytest.mark.parametrize("signals,current,state,overrides,queued,target,reason",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision_table(signals, current, state, overrides, queued, target, reason):
    d = decide(signals, current, NOW, state, CFG.model_copy(update=dict(**overrides)), num_queued_at_callers=queued)
    assert (d.target_replicas, d.reason) == (target, reason), d.describe()


def test_the_idle_clock_starts_when_a_replica_first_reports_not_at_deploy():
    """min_replicas 0, one replica starting for 60 s with no traffic (no signals: NO_METRICS). Its first
    report starts the idle clock: to zero only downscale_to_zero_delay_s (20 s) later, not at once."""
    cfg = CFG.model_copy(update=dict(min_replicas=0))
    st = FRESH
    for t in range(0, 61, 10):
        d = decide([], 1, float(t), st, cfg)
        assert (d.target_replicas, d.reason) == (1, Reason.NO_METRICS)
        st = d.state
    d = decide([IDLE], 1, 61.0, st, cfg)
    assert (d.target_replicas, d.reason) == (1, Reason.TO_ZERO_PENDING)
    d = decide([IDLE], 1, 80.0, d.state, cfg)
    assert (d.target_replicas, d.reason) == (1, Reason.TO_ZERO_PENDING)
    d = decide([IDLE], 1, 81.0, d.state, cfg)
    assert (d.target_replicas, d.reason) == (0, Reason.TO_ZERO)
    # a request in flight restarts the clock
    d = decide([busy(1)], 1, 90.0, d.state, cfg)
    d = decide([IDLE], 1, 91.0, d.state, cfg)
    assert d.reason == Reason.TO_ZERO_PENDING and d.state.idle_since == 91.0


def test_a_request_no_in_flight_sample_saw_still_keeps_the_fleet_up():
    """Requests shorter than the metrics interval can start and end between two in-flight samples; the
    replicas' recent-request count (first tokens in their signal window) still shows them. A fleet whose
    replica reports such requests but never one in flight, for longer than downscale_to_zero_delay_s (20 s),
    stays up; the idle clock starts once the window holds no request."""
    cfg = CFG.model_copy(update=dict(min_replicas=0))
    quiet_but_served = S(num_recent_requests=1, ttft_p90_s=0.05)
    d = decide([IDLE], 1, 0.0, FRESH, cfg)
    st = d.state
    for t in range(5, 200, 5):
        d = decide([quiet_but_served], 1, float(t), st, cfg)
        assert (d.target_replicas, d.reason) == (1, Reason.HOLD), t
        st = d.state
    d = decide([IDLE], 1, 200.0, st, cfg)
    assert d.reason == Reason.TO_ZERO_PENDING and d.state.idle_since == 200.0
    d = decide([IDLE], 1, 220.0, d.state, cfg)
    assert (d.target_replicas, d.reason) == (0, Reason.TO_ZERO)


def test_prefill_rule_is_backlog_over_rate_and_slo():
    """2 replicas, 1500 + 500 queued tokens, 400 + 200 tokens/s served: (600 + 2000 / 1 s) / 1000 = 2.6."""
    load = fleet_load([busy(queued_tokens=1500, rate=400), busy(queued_tokens=500, rate=200)], CFG)
    assert load.prefill_units == pytest.approx(2.6)
    d = decide([busy(queued_tokens=1500, rate=400), busy(queued_tokens=500, rate=200)], 2, NOW, FRESH, CFG)
    assert d.up_target == 4 and d.target_replicas == 4          # ceil(2.6 / 0.8)


def test_refill_weight_sets_how_much_of_a_moving_prefix_counts_as_load():
    """A replica that just joined refills its tenants' prefixes (900 of its 1000 tokens/s were cached on the
    other replica). By default (weight 1) that is load like any prefill: 1.9 units at 0.8 -> 3 replicas; at
    weight 0 only the fleet's new prefill (1.0 unit) counts and fits the 2 it has. The refill rate never
    exceeds the prefill rate."""
    assert PolicyConfig().refill_weight == 1.0
    old, new = busy(2, rate=900), busy(2, rate=1000, refill_tokens_per_s=900)
    counted = decide([old, new], 2, NOW, FRESH, CFG)
    assert counted.load.prefill_units == pytest.approx(1.9) and counted.load.refill_units == pytest.approx(0.9)
    assert (counted.target_replicas, counted.reason) == (3, Reason.UP_PREDICTED)
    left_out = decide([old, new], 2, NOW, FRESH, CFG.model_copy(update=dict(refill_weight=0.0)))
    assert left_out.load.prefill_units == pytest.approx(1.0) and left_out.load.refill_units == pytest.approx(0.9)
    assert (left_out.target_replicas, left_out.reason) == (2, Reason.HOLD), left_out.describe()
    half = fleet_load([old, new], CFG.model_copy(update=dict(refill_weight=0.5)))
    assert (half.prefill_units, half.refill_units) == (pytest.approx(1.45), pytest.approx(0.9))
    # capped
    odd = fleet_load([busy(rate=100, refill_tokens_per_s=500)], CFG.model_copy(update=dict(refill_weight=0.0)))
    assert odd.prefill_units == pytest.approx(0.0)
    # the backlog is work due within the SLO wherever it came from: always counted
    assert fleet_load([busy(queued_tokens=500, rate=0)],
                      CFG.model_copy(update=dict(refill_weight=0.0))).prefill_units == \
        pytest.approx(0.5)


def test_upscale_delay_must_hold_and_resets_when_the_condition_goes():
    cfg = CFG.model_copy(update=dict(upscale_delay_s=3.0))
    hot, cool = [busy(9), busy(9)], [busy(5), busy(5)]
    d = decide(hot, 2, 0.0, FRESH, cfg)
    assert (d.target_replicas, d.reason) == (2, Reason.UP_PENDING)
    d = decide(cool, 2, 2.0, d.state, cfg)                      # condition gone: the wait starts over
    assert d.reason is Reason.HOLD and d.state.up_since is None
    d = decide(hot, 2, 2.5, d.state, cfg)
    d = decide(hot, 2, 5.0, d.state, cfg)
    assert d.reason is Reason.UP_PENDING                         # only 2.5 s of the 3 s
    d = decide(hot, 2, 5.6, d.state, cfg)
    assert (d.target_replicas, d.reason) == (3, Reason.UP_PREDICTED)


def test_downscale_goes_to_the_largest_target_seen_during_the_wait():
    """A dip to idle in the middle of the wait does not take the fleet below what the busier moments need."""
    s = FRESH
    for t, sig in [(0, [busy(2)] * 4), (5, [IDLE] * 4), (10.5, [IDLE] * 4)]:
        d = decide(sig, 4, t, s, CFG)
        s = d.state
    assert (d.target_replicas, d.reason) == (2, Reason.DOWN)


@pytest.mark.parametrize("start", [1, 2, 8])
@pytest.mark.parametrize("total_running", [1, 2, 4, 6.6, 10, 14, 16, 19, 30])
@pytest.mark.parametrize("headroom", [0.0, 1.5, 3.0])
def test_no_flapping_a_steady_load_settles_without_reversing(total_running, start, headroom):
    """Hysteresis: under a steady load the count moves in one direction only, then stays (with and without
    the arrival headroom, and with the trend term on: a steady load has no rising trend)."""
    cfg = CFG.model_copy(update=dict(headroom_z=headroom, trend_lead_s=10.0, trend_window_s=30.0))
    rate = 0.3 * total_running             # 3 requests/s per unit of load (10 running sequences)
    n, s, t, counts = start, FRESH, 0.0, [start]
    for _ in range(200):
        d = decide([busy(total_running / n, requests_per_s=rate / n)] * n, n, t, s, cfg)
        n, s, t = d.target_replicas, d.state, t + 1.0
        counts.append(n)
    steps = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    assert all(x > 0 for x in steps) or all(x < 0 for x in steps), counts
    assert counts[-50:] == [n] * 50


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="downscale_utilization"):
        PolicyConfig(target_utilization=0.5, downscale_utilization=0.6)
    with pytest.raises(ValueError, match="min_replicas"):
        PolicyConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        PolicyConfig(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="preemption_rate_threshold"):
        PolicyConfig(preemption_rate_threshold=-1)
    with pytest.raises(ValueError, match="refill_weight"):
        PolicyConfig(refill_weight=1.5)


def test_after_the_delay_the_count_follows_the_windows_largest_down_target_without_a_new_delay():
    """Load falls 4 -> 2 -> idle: once the first down is allowed, each later step waits only for the
    busier target to leave the downscale_delay_s window (10 s), not for a fresh 10 s each."""
    s, n, seen = FRESH, 6, {}
    for t in np.arange(0, 40, 0.5):
        running = 16 if t < 5 else 8 if t < 15 else 0     # down targets 4, then 2, then 1
        d = decide([busy(running / n)] * n, n, float(t), s, CFG)
        s, n = d.state, d.target_replicas
        seen.setdefault(n, float(t))
    assert seen == {6: 0.0, 4: 10.0, 2: 15.0, 1: 25.0}


def test_preemptions_must_stay_above_the_threshold_for_the_persist_time():
    """0.5 preemptions/s on one replica (threshold 0.1/s, persist 5 s): the breach counts from the 5th second;
    a quiet tick in between starts the wait over."""
    hot, calm = [busy(2, preemptions_per_s=0.5)], [busy(2)]
    s, seen = FRESH, []
    for t, sig in [(0, hot), (2, hot), (4, calm), (5, hot), (9, hot), (10, hot)]:
        d = decide(sig, 1, float(t), s, CFG)
        s = d.state
        seen.append((t, d.target_replicas, d.reason))
    assert seen == [(0, 1, Reason.HOLD), (2, 1, Reason.HOLD), (4, 1, Reason.HOLD), (5, 1, Reason.HOLD),
                    (9, 1, Reason.HOLD), (10, 2, Reason.UP_SLO)]


def test_a_lasting_breach_doubles_per_replica_start_not_per_cooldown():
    """TTFT p90 stays at 5x the SLO (the old queue drains slowly) while replicas take 10 s to start: the
    reactive step doubles the replicas that report, once each has come up and slo_cooldown_s (5 s) passed,
    instead of doubling the count asked for every 5 s (1, 2, 4, 8, 16 within 20 s)."""
    s, n, asked, ups = FRESH, 1, [-100.0], {}
    for t in np.arange(0, 40, 0.5):
        up = [a for a in asked if t - a >= 10.0]                 # replicas that report
        d = decide([busy(1, ttft_p90_s=5.0)] * len(up), n, float(t), s, CFG)
        s = d.state
        if d.target_replicas > n:
            ups[float(t)] = d.target_replicas
            asked += [float(t)] * (d.target_replicas - n)
            n = d.target_replicas
    assert ups == {0.0: 2, 15.0: 4, 30.0: 8}


@pytest.mark.parametrize("units,per_unit,expected", [
    (0.0, 3.0, 0.0),
    (2.4, 0.0, 3.0),                               # no arrivals measured: the utilization rule alone
    (0.5, 3.0, 0.5 + 1.5 * 0.5 / 1.5 ** 0.5),     # 1.5 requests per SLO: 1.11, two replicas for half a load
    (0.5, 100.0, 0.5 / 0.8),                       # 50 requests per SLO: spikes are small, 0.8 utilization
    (2.4, 3.0, 2.4 + 1.5 * 2.4 / 7.2 ** 0.5),     # 3.74: the headroom sizes a small fleet
    (40.0, 3.0, 50.0),                             # 40 / 0.8 = 50 > 40 + 1.5 x 40 / sqrt(120) = 45.5
    (0.1, 3.0, 0.1 + 1.5 * 0.1),                   # under one request per SLO: at most z x units spare
])
def test_replicas_needed_is_the_larger_of_utilization_and_arrival_headroom(units, per_unit, expected):
    assert replicas_needed(units, CFG.model_copy(update=dict(headroom_z=1.5)), per_unit) == pytest.approx(expected)


HEADROOM_CASES = [
    # id, per-replica running, per-replica requests/s, current, headroom_z, expected target, reason
    ("no headroom: 1.2 units on 2 fit at 0.8", 6, 2.0, 2, 0.0, 2, Reason.HOLD),
    ("z 1.5, 4 requests per SLO: 1.2 + 1.5 x 1.2 / 2 = 2.1 -> 3", 6, 2.0, 2, 1.5, 3, Reason.UP_PREDICTED),
    ("z 1.5, 40 requests per SLO: spikes are small, 2 fit", 6, 20.0, 2, 1.5, 2, Reason.HOLD),
    ("z 1.5, large fleet: 24 units at 0.8 -> 30, as without", 12, 3.0, 20, 1.5, 30, Reason.UP_PREDICTED),
    ("z 1.5 keeps 3 for 0.8 units: the down rule inflates the load first", 8 / 3, 0.4, 3, 1.5, 3, Reason.HOLD),
]


@pytest.mark.parametrize("running,rps,current,headroom,target,reason", [c[1:] for c in HEADROOM_CASES],
                         ids=[c[0] for c in HEADROOM_CASES])
def test_arrival_headroom_table(running, rps, current, headroom, target, reason):
    cfg = CFG.model_copy(update=dict(headroom_z=headroom, max_replicas=40))
    d = decide([busy(running, requests_per_s=rps)] * current, current, NOW, LONG_DOWN, cfg)
    assert (d.target_replicas, d.reason) == (target, reason), d.describe()


def _ramp(slope_units_per_s: float, cfg: PolicyConfig, seconds: float = 40.0, current: int = 8):
    """Decisions every 0.5 s on a load of 1 + slope x t units (decoding sequences, 10 per unit)."""
    s, d = FRESH, None
    for t in np.arange(0.0, seconds, 0.5):
        units = max(0.0, 1.0 + slope_units_per_s * float(t))
        d = decide([busy(units * 10 / current)] * current, current, float(t), s, cfg)
        s = d.state
    return d


def test_a_rising_load_is_projected_over_the_lead_time():
    """A load rising 0.1 units/s: with a 10 s lead the fleet is sized for 1 more unit than today's."""
    cfg = CFG.model_copy(update=dict(trend_lead_s=10.0, trend_window_s=30.0))
    d = _ramp(0.1, cfg)
    assert d.load.trend_units == pytest.approx(1.0, rel=1e-6)
    assert d.load.projected_units == pytest.approx(d.load.load_units + 1.0)
    no_trend = _ramp(0.1, cfg.model_copy(update=dict(trend_lead_s=0.0)))
    assert no_trend.load.trend_units == 0.0
    assert (no_trend.up_target, d.up_target) == (7, 8)          # ceil(4.95 / 0.8) vs ceil(5.95 / 0.8)


def test_a_falling_or_flat_load_has_no_trend_and_a_short_history_none_yet():
    cfg = CFG.model_copy(update=dict(trend_lead_s=10.0, trend_window_s=30.0))
    assert _ramp(-0.02, cfg).load.trend_units == 0.0
    assert _ramp(0.0, cfg).load.trend_units == 0.0
    assert _ramp(0.1, cfg, seconds=10.0).load.trend_units == 0.0     # 10 s of samples < half the window


def test_a_rising_trend_holds_off_a_scale_in():
    """10 replicas for a load of ~2.5 units that rises 0.05 units/s: without the trend the down rule would
    take the fleet down; with a 30 s lead it keeps more, as the load will need them."""
    cfg = CFG.model_copy(update=dict(trend_lead_s=30.0, trend_window_s=30.0, downscale_delay_s=0.0))
    with_trend = _ramp(0.05, cfg, seconds=30.0, current=10)
    without = _ramp(0.05, cfg.model_copy(update=dict(trend_lead_s=0.0)), seconds=30.0, current=10)
    assert with_trend.down_target > without.down_target
