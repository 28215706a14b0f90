"""An option of the scaling rule (autoscale/policy.py), issue 29: `feedforward_burst_hold_s`: with
`feedforward_target`, after an evidence episode that was a burst the fleet keeps the burst's largest target that
long before the feed-forward target takes it down."""
from __future__ import annotations

import numpy as np

from affinity_serve.autoscale.policy import PolicyState, decide
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, busy

# C = 48 sequences a replica (the mix pool's prior), R = 1000 tokens/s, TTFT SLO 1 s, z 2
Z2 = CFG.model_copy(update=dict(decode_seqs_per_replica=48.0, headroom_z=2.0, downscale_delay_s=30.0))


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
