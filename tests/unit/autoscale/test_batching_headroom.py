"""Two options of the scaling rule (autoscale/policy.py), issue 29:

- `batching_headroom`: while the load fits that many replicas, the headroom for arrival noise priced as a
  continuous-batching replica meets a spike (its prefill due within the TTFT SLO, its sequences needing batch
  slots), not as the spike's whole work;
- `feedforward_burst_hold_s`: with `feedforward_target`, after an evidence episode that was a burst the fleet
  keeps the burst's largest target that long before the feed-forward target takes it down."""
from __future__ import annotations

import math

import numpy as np
import pytest

from affinity_serve.autoscale.policy import PolicyState, Reason, decide, replicas_needed
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, busy

# C = 48 sequences a replica (the mix pool's prior), R = 1000 tokens/s, TTFT SLO 1 s, z 2
Z2 = CFG.model_copy(update=dict(decode_seqs_per_replica=48.0, headroom_z=2.0, downscale_delay_s=30.0))
BATCH = Z2.model_copy(update=dict(batching_headroom=1e9))          # at any load
BATCH1 = Z2.model_copy(update=dict(batching_headroom=1.0))          # while the load fits one replica


def chat(units_decode: float, prefill_rate: float, rps: float, current: int, **kw) -> list[S]:
    """`current` replicas sharing `units_decode` x 48 decoding sequences, `prefill_rate` uncached tokens/s and
    `rps` arrivals/s."""
    one = busy(units_decode * 48 / current, rate=prefill_rate / current, requests_per_s=rps / current, **kw)
    return [one] * current


@pytest.mark.parametrize("batch", [BATCH, BATCH1], ids=["any load", "under 1 replica"])
def test_a_low_chat_load_keeps_one_replica_where_the_whole_work_headroom_asks_for_two(batch):
    """0.4 units of decode (19 sequences) + 0.1 of prefill at 1 request/s: one request per SLO window, so
    the whole-work headroom is z x units = 1.0: 0.5 + 1.0 = 1.5 -> 2 replicas. A batching replica takes a
    spike of 2 requests inside its batch: their prefill is 2 x 0.1 = 0.2 of a replica within the SLO, and
    z std of the 19 decoding sequences is 2 x sqrt(19.2) / 48 = 0.18: 0.5 + 0.38 = 0.88 -> 1 replica."""
    sig = chat(0.4, 100.0, 1.0, 1)
    off = decide(sig, 1, 1000.0, PolicyState(), Z2)
    on = decide(sig, 1, 1000.0, PolicyState(), batch)
    assert on.load.load_units == pytest.approx(0.5)
    assert (off.up_target, off.target_replicas, off.reason) == (2, 2, Reason.UP_PREDICTED)
    assert (on.up_target, on.target_replicas, on.reason) == (1, 1, Reason.HOLD)
    assert replicas_needed(0.5, batch, 2.0, prefill_share=0.2, decode_capacity=48.0) == pytest.approx(
        0.5 + 2 * 0.1 + 2 * math.sqrt(0.4 / 48))
    # the down rule still has its band: at 2 replicas the load x 1.6 (0.8 units, 1.6 requests per SLO) needs
    # 0.8 + 2 x 0.16 / sqrt(1.6) + 2 x sqrt(0.64 / 48) = 1.28 -> 2 are kept; the gain is in not asking for
    # the second one (today's down rule asks 0.8 + 2 x 0.8 / sqrt(1.6) = 2.06 -> 3 there)
    down = decide(chat(0.4, 100.0, 1.0, 2), 2, 1000.0, PolicyState(down_since=900.0), batch)
    assert (down.down_target, down.target_replicas) == (2, 2)
    assert decide(chat(0.4, 100.0, 1.0, 2), 2, 1000.0, PolicyState(down_since=900.0), Z2).down_target == 3


def test_a_spike_whose_prefill_is_due_within_the_slo_keeps_its_headroom():
    """The same 0.5 units, all prefill (long prompts, no decode): a spike's work is its prefill, all due
    within the TTFT SLO, so the headroom is the whole-work one: 0.5 + 2 x 0.5 = 1.5 -> 2 either way."""
    sig = chat(0.0, 500.0, 1.0, 1)
    off = decide(sig, 1, 1000.0, PolicyState(), Z2)
    on = decide(sig, 1, 1000.0, PolicyState(), BATCH)
    assert off.up_target == on.up_target == 2


@pytest.mark.parametrize("decode,prefill_rate,rps,current", [
    (28.0, 12000.0, 120.0, 40),       # 40 units at 3 requests a unit: 40 / 0.8 = 50 either way
    (4.0, 1000.0, 40.0, 8),           # 5 units, 8 requests a unit: linear 6.25 -> 7 either way
])
def test_a_high_load_is_sized_by_the_utilization_as_without_the_option(decode, prefill_rate, rps, current):
    cfg_off, cfg_on = (c.model_copy(update=dict(max_replicas=64)) for c in (Z2, BATCH))
    sig = chat(decode, prefill_rate, rps, current)
    off = decide(sig, current, 1000.0, PolicyState(), cfg_off)
    on = decide(sig, current, 1000.0, PolicyState(), cfg_on)
    assert on.up_target == off.up_target == math.ceil((decode + prefill_rate / 1000) / 0.8 - 1e-9)


def test_a_burst_still_scales_out_with_the_option():
    """One replica at the low chat load, then a burst: 100 sequences decoding, 10 requests waiting with 3000
    uncached tokens queued, 500 tokens/s served, 10 requests/s. The queue prices arrivals at 300 tokens each
    (3000 tokens/s) plus the backlog within the SLO (3000): 6 units of prefill + 100 / 48 of decode = 8.1,
    10 requests per SLO window. At once (the load exceeds the one replica: no up delay) the fleet goes to
    8.1 + 2 x 6 / sqrt(10) + 2 x sqrt(2.08 / 48) = 12.3 -> 13 replicas (the whole-work headroom: 8.1 + 2 x
    8.1 / sqrt(10) = 13.2 -> 14): the spike's prefill keeps its headroom, only the batch's share is less."""
    cfg_on, cfg_off = (c.model_copy(update=dict(max_replicas=16)) for c in (BATCH, Z2))
    state = PolicyState()
    for t in np.arange(0.0, 10.0, 0.5):                      # the quiet load first: it holds 1
        d = decide(chat(0.4, 100.0, 1.0, 1), 1, float(t), state, cfg_on)
        assert d.target_replicas == 1
        state = d.state
    burst = [busy(100, waiting=10, queued_tokens=3000, rate=500, requests_per_s=10.0)]
    on = decide(burst, 1, 10.0, state, cfg_on)
    off = decide(burst, 1, 10.0, PolicyState(), cfg_off)
    assert (on.target_replicas, on.reason) == (13, Reason.UP_PREDICTED)
    assert (off.target_replicas, off.reason) == (14, Reason.UP_PREDICTED)
    # bounded to a load that fits one replica, the burst's 10 replicas at 0.8 get the whole-work headroom
    bounded = decide(burst, 1, 10.0, PolicyState(), BATCH1.model_copy(update=dict(max_replicas=16)))
    assert bounded.target_replicas == 14


def test_the_bound_applies_the_batching_price_only_while_the_load_fits_that_many_replicas():
    """0.4 + 0.1 units: linear 0.625 <= 1, the batching price; 1.6 + 0.4 units at 4 requests/s: linear 2.5 > 1,
    the whole-work headroom (2 + 2 x 2 / sqrt(4) = 4), as without the option; at any load, 2 + 2 x 0.4 / 2 +
    2 x sqrt(1.6 / 48) = 2.77."""
    assert replicas_needed(2.0, BATCH1, 2.0, prefill_share=0.2, decode_capacity=48.0) == pytest.approx(4.0)
    assert replicas_needed(2.0, BATCH, 2.0, prefill_share=0.2, decode_capacity=48.0) == pytest.approx(
        2.0 + 0.4 + 2 * math.sqrt(1.6 / 48))
    assert replicas_needed(0.5, BATCH1, 2.0, prefill_share=0.2, decode_capacity=48.0) == pytest.approx(
        0.5 + 0.2 + 2 * math.sqrt(0.4 / 48))


# ---------------------------------------------------------------- feedforward_burst_hold_s
FF = Z2.model_copy(update=dict(decode_seqs_per_replica=10.0, feedforward_target=True, feedforward_hold_s=10.0))
FF_BURST = FF.model_copy(update=dict(feedforward_burst_hold_s=60.0))


def trajectory(signals_at, cfg, seconds: float, current: int) -> dict[float, int]:
    """Decisions every 0.5 s, the fleet following each (new replicas report at once): time -> target."""
    s, out = PolicyState(), {}
    for t in np.arange(0.0, seconds, 0.5):
        d = decide(signals_at(float(t), current), current, float(t), s, cfg)
        s, current = d.state, d.target_replicas
        out[float(t)] = current
    return out


def queue_at_60(t: float, n: int) -> list[S]:
    """2 units of decode at 2 requests/s (feed-forward target 3); from 60 s to 70 s each replica queues 2000
    uncached tokens (2 s of prefill at R = 1000: a queue past half the SLO, burst evidence) while the served
    rate does not move."""
    queued = 2000.0 if 60.0 <= t < 70.0 else 0.0
    return [busy(2.0 * 10 / n, waiting=1.0 if queued else 0.0, queued_tokens=queued, requests_per_s=2.0 / n)] * n


def test_after_a_burst_the_fleet_keeps_the_bursts_target_for_the_longer_hold():
    """The queue scales the fleet to 8 at 60 s. With the 10 s hold the fleet is back at the feed-forward
    target 3 once the evidence has been gone for downscale_delay_s (30 s: at 99.5 s). With a 60 s hold after a
    burst it keeps the 8 the rule asked for during the burst until 60 s after its last evidence (69.5 s), and
    then goes to 3."""
    short = trajectory(queue_at_60, FF, 140.0, 8)
    long = trajectory(queue_at_60, FF_BURST, 140.0, 8)
    assert short[59.5] == long[59.5] == 3 and short[60.0] == long[60.0] == 8
    assert short[99.0] == 8 and short[100.0] == 3
    assert long[100.0] == long[129.0] == 8
    assert long[130.0] == 3


def test_an_overload_alone_is_no_burst_and_keeps_the_short_hold():
    """4 units of decode at 4 requests/s on 2 replicas: an overload (evidence, but no SLO breach, queue or
    preemption), the rule scales out to 8 at once; 30 s after the overload ended the fleet goes to the
    feed-forward target 5 after the 10 s hold with or without the 60 s burst hold."""
    def sig(t: float, n: int) -> list[S]:
        return [busy(4.0 * 10 / n, requests_per_s=4.0 / n)] * n

    short = trajectory(sig, FF, 60.0, 2)
    long = trajectory(sig, FF_BURST, 60.0, 2)
    assert short == long
    assert short[0.0] == 8 and short[59.5] == 5


def test_an_slo_breach_is_a_burst_episode():
    slow = [busy(5, ttft_p90_s=2.5, num_recent_requests=20, requests_per_s=1.0)] * 4
    d = decide(slow, 4, 1000.0, PolicyState(num_reporting=4), FF_BURST)
    assert d.state.burst_episode and d.target_replicas == 8
    calm = decide([busy(5, requests_per_s=1.0)] * 4, 4, 1000.0, PolicyState(num_reporting=4), FF_BURST)
    assert not calm.state.burst_episode
