"""The scaling rule's warm-prefix headroom (autoscale/policy.py), issue 29, round 5: `warm_prefix_headroom`
(on by default from round 5 until its re-measure on 2026-11-29, off since): while the fleet's prefix-cache
hit share rises (shared prefixes computed for the
first time, then hit), the headroom prices the prefill the requests arriving now need, not the cold window's
mean. The round's other two options (rounding the headroom, a smaller z at small fleets) lost and were
removed (docs/benchmarks/autoscaling.md)."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, decide, replicas_needed
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, busy

# C = 48, R = 1000 tokens/s, TTFT SLO 1 s, z 2, no trend, no up delay; the headroom as before round 5
Z2 = CFG.model_copy(update=dict(decode_seqs_per_replica=48.0, headroom_z=2.0, downscale_delay_s=30.0,
                                warm_prefix_headroom=False))
WARM = Z2.model_copy(update=dict(warm_prefix_headroom=True))


def test_the_defaults():
    """warm_prefix_headroom was adopted in round 5 (better or equal in 15 of 15 cells then) and turned off again
    when re-measured on 2026-11-29 (off: better or equal in 14 of 15, output-shift seed 2 0.9689 / 1126 ->
    0.9978 / 1081); the removed options are refused, not silently ignored."""
    assert PolicyConfig().warm_prefix_headroom is False
    for gone in ("headroom_round", "headroom_full_replicas", "batching_headroom"):
        with pytest.raises(ValueError, match=gone):
            PolicyConfig(**{gone: 1})


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
