"""The planner-style feed-forward target (`feedforward_target`), autoscale/policy.py: a steady load held at
arrivals x work per request over target_utilization instead of the scale-down band, and the rule's reactive
parts still scaling out when their evidence fires."""
from __future__ import annotations

import numpy as np
import pytest

from affinity_serve.autoscale.policy import (Capacity, PolicyState, Reason, decide, feedforward_decode_units,
                                             fleet_load)
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, OK_LATENCY, busy

# 30 s down delay and window, the 1.6 band (0.8 / 0.5), headroom for arrival noise, no trend
BASE = CFG.model_copy(update=dict(downscale_delay_s=30.0, headroom_z=2.0))
FF = BASE.model_copy(update=dict(feedforward_target=True, feedforward_hold_s=10.0))


def steady(units: float, current: int, rate: float = 0.0) -> list[S]:
    """`current` replicas carrying `units` of decode load (10 sequences a unit), `rate` arrivals/s in all."""
    return [busy(units * 10 / current, requests_per_s=rate / current)] * current


def run(signals_at, cfg, seconds: float, current: int):
    """Decisions every 0.5 s; the fleet follows each decision (a scale-up's replicas report at once)."""
    s, d = PolicyState(), None
    for t in np.arange(0.0, seconds, 0.5):
        d = decide(signals_at(float(t), current), current, float(t), s, cfg)
        s, current = d.state, d.target_replicas
    return d


def test_a_steady_load_goes_down_to_the_feed_forward_target_where_the_band_holds_the_fleet():
    """4 units of decode at 4 requests/s on 8 replicas. Today's up rule already wants 8 with the headroom for
    arrival noise (4 + 2 x 4 / sqrt(4) = 8), and its down rule sizes the load x 1.6 with it: need(6.4) =
    6.4 + 2 x 6.4 / sqrt(6.4) = 11.5, so the fleet holds 8; the feed-forward target is ceil(4 / 0.8) = 5, and
    with no evidence for more the fleet goes there."""
    sig = lambda t, n: steady(4.0, n, rate=4.0)          # noqa: E731
    off = run(sig, BASE, 60.0, 8)
    assert (off.up_target, off.down_target, off.target_replicas, off.feedforward_target) == (8, 12, 8, 0)
    on = run(sig, FF, 60.0, 8)
    assert on.feedforward_target == 5
    assert (on.target_replicas, on.reason) == (5, Reason.HOLD)
    # at 5 replicas no headroom is added back while nothing asks for it: the up rule is the feed-forward one
    assert on.up_target == 5
    # the down step waited the 30 s without evidence after the start (the 8 replicas are not overloaded) and
    # then went at once to the largest feed-forward target of the 10 s hold
    s, first_down = PolicyState(), None
    for t in np.arange(0.0, 40.0, 0.5):
        d = decide(sig(float(t), 8), 8, float(t), s, FF)
        s = d.state
        if d.target_replicas < 8 and first_down is None:
            first_down = float(t)
    assert first_down == pytest.approx(30.0)


def test_the_feed_forward_decode_is_a_planners_arrivals_x_output_x_step_over_the_batch():
    """2 requests/s of 100-token outputs; step costs base 10 ms + 1e-5 s per context token at 500 tokens:
    C_tpot = (0.1 - 0.01) / (1e-5 x 500) = 18 sequences in a 0.1 s step, so the decode is 2 x 100 x 0.1 / 18 =
    1.11 replicas, where the 6 sequences running read 6 / 18 = 0.33 now."""
    s = S(num_running=6, requests_per_s=2.0, mean_output_tokens=100, step_base_s=0.01,
          decode_s_per_context_token=1e-5, mean_context_tokens=500, prefill_s_per_token=1e-3, **OK_LATENCY)
    assert feedforward_decode_units(s, Capacity(1000, 18), 18, FF) == pytest.approx(2 * 100 * 0.1 / 18)
    # a shift to longer outputs shows in the running sequences before the finished ones' mean: the larger
    assert feedforward_decode_units(S(num_running=30, requests_per_s=2.0, mean_output_tokens=100),
                                    Capacity(1000, 18), 18, FF) == pytest.approx(30 / 18)
    # no outputs finished yet: the running sequences alone
    assert feedforward_decode_units(S(num_running=6), Capacity(1000, 18), 18, FF) == pytest.approx(6 / 18)
    load = fleet_load([s], FF)
    assert load.feedforward_units == pytest.approx(load.decode_units * 0 + 2 * 100 * 0.1 / 18)


def test_a_queue_of_longer_prompts_still_scales_out_and_holds_the_band_afterwards():
    """5 replicas at their feed-forward target (2 units, 2 requests/s). At t=60 prompts grow: each replica
    queues 2000 uncached tokens (2 s of prefill at R = 1000, past half the 1 s SLO) while the served rate has
    not moved, so the feed-forward load reads the same 2 units. The queue is evidence: the rule's full up
    target (backlog over the SLO: 10 units more) applies and the fleet scales out as it does without the
    option. When the queue is gone the fleet keeps the band for downscale_delay_s before the feed-forward
    target may take it down."""
    def sig(t: float, n: int) -> list[S]:
        queued = 2000.0 if 60.0 <= t < 70.0 else 0.0
        return [busy(2.0 * 10 / n, waiting=1.0 if queued else 0.0, queued_tokens=queued, requests_per_s=2.0 / n)] * n

    before = run(sig, FF, 59.5, 8)
    assert (before.target_replicas, before.feedforward_target) == (3, 3)
    shifted = run(sig, FF, 60.5, 8)                     # the decision at t=60
    off = run(sig, BASE, 60.5, 8)
    assert shifted.feedforward_target == 3                              # the served rate did not move
    assert shifted.load.num_queued_replicas == shifted.load.num_replicas
    assert shifted.target_replicas == 8 and shifted.reason == Reason.UP_PREDICTED
    assert off.target_replicas == 8
    # the queue drained at 70 s: 25 s later the band still holds (evidence within downscale_delay_s) ...
    held = run(sig, FF, 95.0, 8)
    assert held.target_replicas == 8
    # ... and 30 s after the last evidence, with the 10 s hold, the fleet is back at the feed-forward target
    back = run(sig, FF, 110.0, 8)
    assert back.target_replicas == 3


def test_an_slo_breach_is_evidence_and_scales_out_as_without_the_option():
    slow = [busy(5, ttft_p90_s=2.5, num_recent_requests=20, requests_per_s=1.0)] * 4
    state = PolicyState(num_reporting=4)
    on = decide(slow, 4, 1000.0, state, FF)
    off = decide(slow, 4, 1000.0, state, BASE)
    assert on.feedforward_target == 3                   # 2 units of decode / 0.8
    assert (on.target_replicas, on.reason) == (off.target_replicas, off.reason) == (8, Reason.UP_SLO)


def test_the_feed_forward_prefill_prices_whole_prompts_as_a_planner_does():
    """1000 uncached tokens/s of 3000 prompt tokens/s (the cache saves two thirds) at R = 1000: the served load
    is 1 replica, the feed-forward one 3: a planner's profile of uncached prompts keeps what the cache saves
    as spare capacity (with the served tokens alone ours lost 0.03 of diurnal's attainment)."""
    s = busy(0, rate=1000.0, prompt_tokens_per_s=3000.0, requests_per_s=2.0)
    load = fleet_load([s], FF)
    assert load.prefill_units == pytest.approx(1.0)
    assert load.feedforward_units == pytest.approx(3.0)
