"""A replica at its batch cap with requests waiting (`saturation_scale_out`) and the shorter hold on a falling
trend (`falling_trend_hold_s`), autoscale/policy.py: decisions the fleet's sums alone would not make."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.policy import PolicyState, Reason, decide, fleet_load, saturated
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_forecast_band import BAND, run
from tests.unit.autoscale.test_policy import CFG, OK_LATENCY

NOW = 1000.0
#: the C prior 64 (the batch cap): a replica is full at 64 sequences, whatever their lengths
SAT = CFG.model_copy(update=dict(decode_seqs_per_replica=64.0, saturation_scale_out=True, max_replicas=8))


def rep(running: float, waiting: float = 0.0, cap: float = 64.0) -> S:
    return S(num_running=running, num_waiting=waiting, num_in_flight=running + waiting, kv_cache_usage=0.3,
             max_num_seqs=cap, **OK_LATENCY)


# the output shift's run with the narrow band: one replica full with 10 waiting, the other at 30 sequences
SKEWED = [rep(64, 10), rep(30)]


def test_a_capped_replica_with_a_queue_asks_for_one_more_replica_the_fleet_mean_would_not():
    load = fleet_load(SKEWED, SAT)
    assert load.num_saturated == 1
    # the sums: 94 sequences of 2 x 64 slots, 1.47 replicas of load; at 0.8 utilization 2 replicas suffice
    assert load.load_units == pytest.approx(94 / 64)
    off = decide(SKEWED, 2, NOW, PolicyState(), SAT.model_copy(update=dict(saturation_scale_out=False)))
    assert (off.up_target, off.target_replicas, off.reason) == (2, 2, Reason.HOLD)
    on = decide(SKEWED, 2, NOW, PolicyState(), SAT)
    assert (on.up_target, on.target_replicas, on.reason) == (2, 3, Reason.UP_SATURATED)


def test_it_asks_once_per_replica_starting_and_waits_out_the_cooldown_after_one_comes_up():
    # a replica already asked for and starting (3 heading, 2 reporting): nothing more
    assert decide(SKEWED, 3, NOW, PolicyState(), SAT).target_replicas == 3
    # it came up 2 s ago (3 report, the full one still drains its long sequences): no fourth yet
    came_up = PolicyState(num_reporting=3, ready_time=NOW - 2)
    three = SKEWED + [rep(5)]
    assert decide(three, 3, NOW, came_up, SAT).target_replicas == 3
    assert decide(three, 3, NOW, PolicyState(num_reporting=3, ready_time=NOW - 6), SAT).target_replicas == 4


def test_a_full_batch_without_a_queue_or_a_queue_below_the_cap_is_not_saturation():
    assert not saturated(rep(64, 0.5))                  # at the cap, nothing waiting: every request has a slot
    assert not saturated(rep(50, 10))                   # waiting below the cap: KV or the prefill budget, not slots
    assert not saturated(rep(64, 10, cap=0))            # no cap reported
    assert saturated(rep(0.95 * 64, 1.0))
    d = decide([rep(64, 0), rep(30)], 2, NOW, PolicyState(), SAT)
    assert (d.target_replicas, d.reason) == (2, Reason.HOLD)


def test_a_saturated_replica_blocks_scale_in_that_the_fleet_mean_allows():
    # 70 sequences on 4 replicas: 1.1 units, the down rule allows ceil(1.1 x 1.6 / 0.8) = 3 after its delay
    fleet = [rep(64, 3), rep(2), rep(2), rep(2)]
    long_down = PolicyState(down_since=NOW - 60, num_reporting=4, ready_time=NOW - 60, last_up_time=NOW - 60)
    off = decide(fleet, 4, NOW, long_down, SAT.model_copy(update=dict(saturation_scale_out=False)))
    assert (off.target_replicas, off.reason) == (3, Reason.DOWN)
    on = decide(fleet, 4, NOW, long_down, SAT)
    assert on.target_replicas >= 4 and on.reason != Reason.DOWN


def test_a_falling_trend_with_a_short_hold_follows_the_recent_down_targets_not_the_window_s_oldest():
    """The load falls 0.05 units/s, the down condition held for the 30 s window: by default the fleet stays at
    the window's largest down target (its oldest, the load of 30 s ago); with a 10 s hold at the largest of
    the last 10 s; with 0 at today's."""
    cfg = BAND.model_copy(update=dict(forecast_error_band=False, downscale_delay_s=30.0))
    falling = lambda t: max(0.5, 5.0 - 0.05 * t)       # noqa: E731
    whole = run(falling, cfg, 70.0)
    ten = run(falling, cfg.model_copy(update=dict(falling_trend_hold_s=10.0)), 70.0)
    zero = run(falling, cfg.model_copy(update=dict(falling_trend_hold_s=0.0)), 70.0)
    # at t=69.5 (1.525 units, 1.025 one start-up ahead): today's down target ceil(1.025 x 2) = 3; 10 s ago
    # (2.025 units, 1.525 ahead) ceil(3.05) = 4; 30 s ago ceil(2.525 x 2) = 6
    assert zero.down_target == ten.down_target == whole.down_target == 3
    assert (whole.target_replicas, ten.target_replicas, zero.target_replicas) == (6, 4, 3)



def test_the_short_hold_needs_the_fall_confirmed_over_the_last_start_up():
    """`falling_trend_confirm`: a load that stepped down to a plateau (5 -> 2 units at t=45) still falls over
    the 30 s trend window but not over the last start-up (10 s), so the window's largest down target holds
    (the base trace's post-burst plateau); a load that keeps falling follows today's target as before."""
    cfg = BAND.model_copy(update=dict(forecast_error_band=False, downscale_delay_s=10.0))
    short = cfg.model_copy(update=dict(falling_trend_hold_s=0.0))
    confirmed = short.model_copy(update=dict(falling_trend_confirm=True))
    step = lambda t: 5.0 if t < 45 else 2.0            # noqa: E731
    at_58 = [run(step, c, 58.0) for c in (cfg, short, confirmed)]
    assert all(d.load.falling_units < 0 for d in at_58)                    # the 30 s slope still falls
    # the down rule alone would allow 2 on the plateau, under the up rule's 3 (2 units at 0.8): the down
    # target never goes below the up target (scaling in to 2 would scale straight back out), so each holds 3
    assert [d.up_target for d in at_58] == [3, 3, 3]
    assert [d.down_target for d in at_58] == [3, 3, 3]
    assert [d.target_replicas for d in at_58] == [3, 3, 3]
    falling = lambda t: max(0.5, 5.0 - 0.05 * t)       # noqa: E731
    slow = cfg.model_copy(update=dict(downscale_delay_s=30.0))
    assert [run(falling, c, 70.0).target_replicas for c in (
        slow, slow.model_copy(update=dict(falling_trend_hold_s=0.0)),
        slow.model_copy(update=dict(falling_trend_hold_s=0.0, falling_trend_confirm=True)))] == [6, 3, 3]


def test_a_spare_replica_floor_keeps_a_small_fleet_one_above_its_up_target_under_a_narrow_band():
    """`downscale_spare_replicas`: 9 sequences a replica-unit of 10 on 3 replicas (0.9 units): the up rule asks
    for ceil(0.9 / 0.8) = 2, a narrow band (0.65: x 1.23) allows 2 as well; one spare replica keeps 3."""
    cfg = CFG.model_copy(update=dict(downscale_utilization=0.65))
    fleet = [S(num_running=3, num_in_flight=3, kv_cache_usage=0.1, **OK_LATENCY)] * 3
    long_down = PolicyState(down_since=NOW - 60)
    narrow = decide(fleet, 3, NOW, long_down, cfg)
    assert (narrow.up_target, narrow.down_target, narrow.target_replicas) == (2, 2, 2)
    spare = decide(fleet, 3, NOW, long_down, cfg.model_copy(update=dict(downscale_spare_replicas=1)))
    assert (spare.down_target, spare.target_replicas, spare.reason) == (3, 3, Reason.HOLD)


def test_a_falling_trend_never_scales_in_below_the_up_target_so_a_steady_tail_does_not_flap():
    """A burst (6 replicas of load) ends and one light stream stays (0.9 units): on the falling trend the down
    rule sized for no load a start-up ahead (down target 1 against an up target of 2), so the fleet went
    3 -> 1 and the up rule took it straight back to 2 (seen live: 3, 1, 3, 1, 2, 1 within 30 s)."""
    from affinity_serve.autoscale.policy import PolicyConfig
    cfg = PolicyConfig(min_replicas=1, max_replicas=3, upscale_delay_s=1.0, downscale_delay_s=5.0,
                       online_capacity=False, decode_seqs_per_replica=1.0, ttft_slo_s=30, tpot_slo_s=30)
    st, cur, counts = PolicyState(), 3, []
    for i in range(600):
        t = i * 0.1
        running = 6.0 if t < 20 else 0.9
        d = decide([S(num_running=running / cur, num_in_flight=running / cur, num_recent_requests=2,
                      requests_per_s=0.2 / cur) for _ in range(cur)], cur, t, st, cfg)
        st, cur = d.state, d.target_replicas
        assert d.down_target >= d.up_target
        counts.append(cur)
    changes = [b for a, b in zip(counts, counts[1:]) if a != b]
    assert changes == [2]                # 3 -> 2 once, then it holds
