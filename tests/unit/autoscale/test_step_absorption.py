"""Absorbing a step in the work per request for one replica start-up (issue 29): the prefill load counts the
uncached prompt tokens (so a prefix cache that stops hitting raises it), the spare capacity that carries a
cache collapse until new replicas serve (`cache_loss_headroom`), and the trend projected over the replicas'
measured start-up time (`measured_startup`)."""
from __future__ import annotations

import math

import pytest

from affinity_serve.autoscale.policy import (PolicyConfig, PolicyState, Reason, cache_loss_replicas, decide,
                                            fleet_load, trend_lead_s)
from affinity_serve.autoscale.signals import ReplicaSignals, SignalRecorder
from benchmarks.autoscale import RayDefaultPolicy

BASE = dict(min_replicas=1, max_replicas=16, ttft_slo_s=1.0, tpot_slo_s=0.15, prefill_tokens_per_s=20_000.0,
            decode_seqs_per_replica=48.0, upscale_delay_s=0.0, headroom_z=0.0, trend_lead_s=10.0)
CFG = PolicyConfig(**BASE)
LOAD = dict(num_running=2, num_waiting=0, num_in_flight=2, kv_cache_usage=0.1, num_queued_prefill_tokens=0,
            num_preemptions_total=0)


def reuse_fleet(hit_rate: float, n: int = 3) -> list[ReplicaSignals]:
    """n replicas, each 6 req/s of 3000-token prompts of which `hit_rate` is served from the prefix cache,
    12 sequences in flight (the same count whatever the hit rate)."""
    return [ReplicaSignals(num_running=12, num_in_flight=12, requests_per_s=6.0, num_recent_requests=60,
                           prefill_tokens_per_s=6.0 * 3000 * (1 - hit_rate), prompt_tokens_per_s=6.0 * 3000,
                           ttft_p90_s=0.2, tpot_p90_s=0.02)] * n


def test_the_recorder_reports_whole_prompts_apart_from_their_uncached_tokens():
    r = SignalRecorder(window_s=10.0)
    for i in range(10):                                  # 1 req/s of 3000-token prompts, 2700 of them cached
        r.on_first_token(0.5 + i, ttft_s=0.1, num_uncached_prompt_tokens=300, num_prompt_tokens=3000)
    s = r.snapshot(10.0, **LOAD)
    assert s.prefill_tokens_per_s == pytest.approx(300.0)
    assert s.prompt_tokens_per_s == pytest.approx(3000.0)
    plain = SignalRecorder(window_s=10.0)               # a caller that gives no whole prompt: nothing cached
    for i in range(10):
        plain.on_first_token(0.5 + i, ttft_s=0.1, num_uncached_prompt_tokens=300)
    assert plain.snapshot(10.0, **LOAD).prompt_tokens_per_s == pytest.approx(300.0)


def test_a_cache_collapse_raises_the_prefill_load_by_the_uncached_tokens_and_not_the_request_count():
    """R is per uncached token: at the same arrivals and in-flight count, a hit rate falling from 0.9 to 0
    multiplies the prefill load by 10, which no target of the request-count rule sees."""
    warm, cold = fleet_load(reuse_fleet(0.9), CFG), fleet_load(reuse_fleet(0.0), CFG)
    assert warm.prefill_units == pytest.approx(3 * 1800 / 20_000)
    assert cold.prefill_units == pytest.approx(10 * warm.prefill_units)
    assert warm.cached_units == pytest.approx(3 * 16_200 / 20_000) and cold.cached_units == 0.0
    for target in (2, 4, 8):
        serve = [RayDefaultPolicy(target, 1, 32, 0.0, 0.0, 5.0, 1.0, "serve", "serve").decide(
            sum(s.num_in_flight for s in f), 3, 0.0) for f in (reuse_fleet(0.9), reuse_fleet(0.0))]
        assert serve[0] == serve[1]


def test_the_fleet_holds_what_carries_a_cache_collapse_for_one_start_up():
    """With the cache saving 2.43 replicas of prefill, the fleet keeps (load + saved) / (1 + SLO / start-up)
    replicas (4): 2 would do without it (0.27 + 0.75 units of load at 0.8)."""
    warm = reuse_fleet(0.9)
    on = decide(warm, 3, 0.0, PolicyState(), CFG)
    off = decide(warm, 3, 0.0, PolicyState(), PolicyConfig(**BASE, cache_loss_headroom=False))
    load = on.load
    floor = (load.projected_units + load.cached_units) / (1 + 1.0 / 10.0)
    assert cache_loss_replicas(load, CFG, 10.0) == pytest.approx(floor)
    assert off.up_target == math.ceil(load.load_units / 0.8) == 2 and off.reason is not Reason.UP_PREDICTED
    assert on.target_replicas == math.ceil(floor) == 4 and on.reason is Reason.UP_PREDICTED
    # it is also a floor for the down rule: the fleet does not scale below it and then straight back up
    assert on.down_target >= on.target_replicas
    # a longer start-up leaves less time to queue through: more replicas
    assert cache_loss_replicas(load, CFG, 30.0) > floor
    # a fleet whose cache saves nothing is sized as without the headroom
    cold = reuse_fleet(0.0, n=3)
    assert (decide(cold, 3, 0.0, PolicyState(), CFG).up_target
            == decide(cold, 3, 0.0, PolicyState(), PolicyConfig(**BASE, cache_loss_headroom=False)).up_target)


def busy(running: float, n: int) -> list[ReplicaSignals]:
    return [ReplicaSignals(num_running=running, num_in_flight=running, num_recent_requests=10,
                           ttft_p90_s=0.1, tpot_p90_s=0.02)] * n


def test_the_start_up_time_is_measured_from_the_ask_to_the_first_report():
    """Replicas asked for at t=0 report 20 s later: the start-up samples read 20 s and the trend is
    projected 20 s ahead (10 s, the configured lead, before any replica came up or with the option off)."""
    s, n, asked = PolicyState(), 1, []
    for t in [x * 0.5 for x in range(0, 60)]:
        reporting = 1 + sum(1 for a in asked if t - a >= 20.0)
        d = decide(busy(100 / reporting, reporting), n, t, s, CFG)    # 100 / 48 = 2.1 units: 3 replicas
        if d.target_replicas > n:
            asked += [t] * (d.target_replicas - n)
        s, n = d.state, d.target_replicas
        if t < 20.0:
            assert trend_lead_s(s, CFG) == 10.0
    assert asked == [0.0, 0.0]
    assert s.startup_samples == (20.0, 20.0) and s.startup_s == 20.0 and s.starting == ()
    assert trend_lead_s(s, CFG) == 20.0
    assert trend_lead_s(s, PolicyConfig(**BASE, measured_startup=False)) == 10.0
    assert trend_lead_s(s, PolicyConfig(**{**BASE, "trend_lead_s": 0.0})) == 0.0      # the trend stays off


def test_the_trend_is_projected_over_the_measured_start_up():
    """The same rising load history projects twice as far with a measured start-up of 20 s as with the
    configured 10 s."""
    history = tuple((float(t), 1.0 + 0.05 * t) for t in range(0, 30))      # +0.05 units/s over 30 s
    sig = busy(48 * 2.5, 3)
    leads = {}
    for samples in ((), (20.0, 20.0)):
        d = decide(sig, 3, 30.0, PolicyState(load_history=history, startup_samples=samples), CFG)
        leads[samples] = d.load.trend_units
    assert leads[()] > 0
    assert leads[(20.0, 20.0)] == pytest.approx(2 * leads[()])


def test_a_scale_down_cancels_the_replicas_still_starting_and_unasked_replicas_give_no_sample():
    cfg = PolicyConfig(**{**BASE, "downscale_delay_s": 0.0})
    d = decide(busy(100, 1), 1, 0.0, PolicyState(), cfg)
    assert d.target_replicas == 3 and d.state.starting == ((0.0, 2),)
    d = decide(busy(1, 1), 3, 1.0, d.state, cfg)                          # the load went: down before they came
    assert d.target_replicas == 1 and d.state.starting == ()
    d = decide(busy(1, 2), 1, 30.0, d.state, cfg)                          # a replica nobody here asked for
    assert d.state.startup_samples == ()
