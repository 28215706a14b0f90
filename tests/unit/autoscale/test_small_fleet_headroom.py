"""Two options of the scaling rule's arrival headroom (autoscale/policy.py), issue 29, round 5:

- `warm_prefix_headroom` (on by default since round 5): while the fleet's prefix-cache hit share rises (shared
  prefixes computed for the first time, then hit), the headroom prices the prefill the requests arriving now
  need, not the cold window's mean;
- `headroom_round`: the headroom adds a replica beyond those the load needs at target_utilization only past
  that fraction of one, so one or two replicas do not pay a whole replica for a few tenths of one;
- `headroom_full_replicas`: `headroom_z` in full only from that many replicas up (of those the load needs),
  in proportion below."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, decide, replicas_needed
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, busy

# C = 48, R = 1000 tokens/s, TTFT SLO 1 s, z 2, no trend, no up delay; the headroom as before round 5
Z2 = CFG.model_copy(update=dict(decode_seqs_per_replica=48.0, headroom_z=2.0, downscale_delay_s=30.0,
                                warm_prefix_headroom=False))
WARM = Z2.model_copy(update=dict(warm_prefix_headroom=True))
ROUND = Z2.model_copy(update=dict(headroom_round=0.5))


def test_the_defaults():
    """warm_prefix_headroom was adopted in round 5 (better or equal in 15 of 15 cells); the rounding and the
    small fleet's z were not (docs/benchmarks/autoscaling.md)."""
    d = PolicyConfig()
    assert (d.warm_prefix_headroom, d.headroom_round, d.headroom_full_replicas) == (True, 0.0, 0)


def chat(share: float, prompt_rate: float = 500.0) -> S:
    """One replica at 1 request/s over a 10 s window (10 recent requests): 500 prompt tokens a request, of
    which `share` hit the prefix cache, and 5 sequences decoding."""
    return busy(5, rate=prompt_rate * (1 - share), prompt_tokens_per_s=prompt_rate, requests_per_s=1.0,
                num_recent_requests=10, kv=0.05)


def run(shares: list[float], cfg, t0: float = 1000.0):
    """Decisions once a second at one replica over the hit shares `shares`; the last decision."""
    state, d = PolicyState(), None
    for i, h in enumerate(shares):
        d = decide([chat(h)], 1, t0 + i, state, cfg)
        state = d.state
    return d


RISING = [0.05 * i for i in range(11)]          # the window's hit share 0 -> 0.5 over 10 s: prefixes warming


def test_prefixes_turning_warm_keep_one_replica_where_the_cold_window_asks_for_two():
    """At 10 s the window's share is 0.5 and rises 0.05/s: the requests arriving now hit about 0.5 + 0.05 x
    5 = 0.75 (half the window's lag). Load: prefill 250 / 1000 + decode 5 / 48 = 0.354 units, one request
    per SLO window. The cold window's headroom is 2 x 0.354: 1.06 -> 2 replicas. Of the prefill, 500 x (0.75
    - 0.5) tokens/s = 0.125 units are prefixes computed once: the spike's are 0.229: 0.354 + 0.458 = 0.81 ->
    1 replica."""
    off, on = run(RISING, Z2), run(RISING, WARM)
    assert on.load.load_units == pytest.approx(0.25 + 5 / 48)
    assert on.load.cold_units == pytest.approx(0.125)
    assert off.load.cold_units == 0.0
    assert (off.up_target, off.target_replicas, off.reason) == (2, 2, Reason.UP_PREDICTED)
    assert (on.up_target, on.target_replicas, on.reason) == (1, 1, Reason.HOLD)
    assert replicas_needed(on.load.load_units, WARM, 1.0 / on.load.load_units, cold_units=0.125) == (
        pytest.approx(on.load.load_units + 2 * (on.load.load_units - 0.125)))


@pytest.mark.parametrize("shares", [[0.5] * 11, [0.5 - 0.04 * i for i in range(11)], RISING[:4]],
                         ids=["warm: flat share", "cache stops hitting: falling share", "too few samples"])
def test_without_a_rising_share_the_headroom_is_the_default_one(shares):
    """A flat share (the prefixes already warm), a falling one (reuse collapses) and the first seconds (the
    samples span less than half the window: no slope yet) leave nothing out."""
    off, on = run(shares, Z2), run(shares, WARM)
    assert on.load.cold_units == 0.0
    assert (on.up_target, on.down_target) == (off.up_target, off.down_target)


def test_the_cold_part_is_at_most_the_prefill():
    """A steep rise (0 -> 0.9 in 10 s: projected past 1) leaves out at most the prefill the load holds."""
    on = run([0.09 * i for i in range(11)], WARM)
    assert 0 < on.load.cold_units <= on.load.prefill_units + 1e-12


def test_without_whole_prompt_reports_nothing_is_left_out():
    sig = busy(5, rate=250.0, requests_per_s=1.0, num_recent_requests=10, kv=0.05)
    state = PolicyState()
    for i in range(11):
        d = decide([sig], 1, 1000.0 + i, state, WARM)
        state = d.state
    assert d.load.cold_units == 0.0 and d.up_target == 2


# ---------------------------------------------------------------- headroom_round
def test_a_fraction_of_a_replica_of_headroom_does_not_add_one():
    """0.44 units at 1 request/s (the real-Serve output shift's chat half): linear 0.55 -> 1 replica; the
    headroom asks 0.44 + 2 x 0.44 = 1.32, an excess of 0.32 over that one: rounded at 0.5 it adds none."""
    sig = [busy(10, rate=230.0, requests_per_s=1.0, num_recent_requests=10, kv=0.05)]
    off = decide(sig, 1, 1000.0, PolicyState(), Z2)
    on = decide(sig, 1, 1000.0, PolicyState(), ROUND)
    assert off.load.load_units == pytest.approx(0.23 + 10 / 48)
    assert (off.up_target, off.target_replicas) == (2, 2)
    assert (on.up_target, on.target_replicas, on.reason) == (1, 1, Reason.HOLD)


@pytest.mark.parametrize("units,rps,off,on", [
    (0.44, 1.0, 1.32, 1.0),        # excess 0.32 over 1 replica: none added
    (0.6, 1.0, 1.8, 1.8),          # excess 0.8 over 1: past 0.5, the headroom as it is (-> 2)
    (10.0, 20.0, 10 + 2 * 10 / 20 ** 0.5, 14.0),  # linear 12.5 -> 13; 14.47: excess 1.47 -> 1 replica
    (4.0, 100.0, 5.0, 5.0),        # 4 + 2 x 4 / 10 = 4.8 < 4 / 0.8: target_utilization sizes it either way
])
def test_the_rounded_headroom(units, rps, off, on):
    per_unit = rps / units
    assert replicas_needed(units, Z2, per_unit) == pytest.approx(off)
    assert replicas_needed(units, ROUND, per_unit) == pytest.approx(on)


def test_the_rounded_headroom_still_scales_a_burst_out():
    """A burst at one replica (3000 queued tokens, 10 requests waiting at 10 requests/s, 50 decoding): the
    load (7.04 units) needs 9 replicas at target_utilization, and its headroom 7.04 + 2 x 7.04 / sqrt(10) = 11.5: an
    excess of 2.5 over 9 adds 2 rounded (3 without)."""
    sig = [busy(50, 10, queued_tokens=3000, rate=500.0, requests_per_s=10.0, num_recent_requests=10,
                prompt_tokens_per_s=500.0, kv=0.5)]
    cfg_off, cfg_on = (c.model_copy(update=dict(max_replicas=32)) for c in (Z2, ROUND))
    off = decide(sig, 1, 1000.0, PolicyState(), cfg_off)
    on = decide(sig, 1, 1000.0, PolicyState(), cfg_on)
    units = off.load.load_units
    assert units == pytest.approx(3.0 + 3.0 + 50 / 48)
    assert off.target_replicas == 12 and on.target_replicas == 11


# ---------------------------------------------------------------- headroom_full_replicas
FULL2 = Z2.model_copy(update=dict(headroom_full_replicas=2))


@pytest.mark.parametrize("units,rps,off,on", [
    (0.44, 1.0, 1.32, 0.88),       # needs 1 replica: z 1, 0.44 + 0.44 -> 1 replica (2 at z 2)
    (1.0, 2.0, 1.0 + 2 / 2 ** 0.5, 1.0 + 2 / 2 ** 0.5),   # needs 2 (1.25): z in full
    (0.0, 1.0, 0.0, 0.0),          # no load, no headroom
])
def test_a_load_one_replica_carries_gets_half_the_z(units, rps, off, on):
    per_unit = rps / units if units else 0.0
    assert replicas_needed(units, Z2, per_unit) == pytest.approx(off)
    assert replicas_needed(units, FULL2, per_unit) == pytest.approx(on)


def test_the_chat_half_keeps_one_replica_with_half_the_z():
    sig = [busy(10, rate=230.0, requests_per_s=1.0, num_recent_requests=10, kv=0.05)]
    assert decide(sig, 1, 1000.0, PolicyState(), Z2).target_replicas == 2
    on = decide(sig, 1, 1000.0, PolicyState(), FULL2)
    assert (on.up_target, on.target_replicas, on.reason) == (1, 1, Reason.HOLD)
