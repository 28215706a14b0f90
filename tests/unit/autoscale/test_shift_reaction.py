"""Reacting to a step in the work per request (issue 29): prefill sized from the queued requests' cost as
soon as they queue (`queued_cost_projection`), and an overloaded fleet scaling without the up delay
(`overload_skips_delay`)."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.policy import (PolicyConfig, PolicyState, Reason, decide, fleet_load,
                                            incoming_prefill_tokens_per_s)
from affinity_serve.autoscale.signals import ReplicaSignals

BASE = dict(min_replicas=1, max_replicas=16, ttft_slo_s=1.0, tpot_slo_s=0.15, prefill_tokens_per_s=20_000.0,
            decode_seqs_per_replica=48.0, upscale_delay_s=2.0, headroom_z=0.0, trend_lead_s=0.0)
CFG = PolicyConfig(**BASE)
#: a chat phase on one replica: 7 req/s of ~300 uncached tokens, 8 sequences decoding
CHAT = dict(num_running=8, num_in_flight=8, prefill_tokens_per_s=2100.0, requests_per_s=7.0,
            num_recent_requests=70, ttft_p90_s=0.05, tpot_p90_s=0.012)


def after_shift(num_waiting: float, queued_tokens: float) -> ReplicaSignals:
    """The chat replica a second after prompts grew to ~8k tokens: its served rate still reads the chat
    phase; requests of the new kind wait (look-back means)."""
    return ReplicaSignals(**CHAT, num_waiting=num_waiting, num_queued_prefill_tokens=queued_tokens)


def test_the_queued_requests_cost_sizes_prefill_before_the_served_rate_moves():
    s = after_shift(num_waiting=2.0, queued_tokens=16_000)
    assert incoming_prefill_tokens_per_s(s, CFG) == pytest.approx(7.0 * 8000)
    off = PolicyConfig(**BASE, queued_cost_projection=False)
    assert incoming_prefill_tokens_per_s(s, off) == 2100.0
    on_load, off_load = fleet_load([s], CFG), fleet_load([s], off)
    # (arrivals x the queued cost + backlog / TTFT SLO) / R against (served rate + backlog / SLO) / R
    assert on_load.prefill_units == pytest.approx((56_000 + 16_000) / 20_000)
    assert off_load.prefill_units == pytest.approx((2100 + 16_000) / 20_000)
    on, off_d = (decide([s], 1, 0.0, PolicyState(), PolicyConfig(**{**BASE, "upscale_delay_s": 0.0}, **kw))
                 for kw in ({}, {"queued_cost_projection": False}))
    assert off_d.target_replicas == 2 < on.target_replicas == 5          # ceil(3.6 + decode / 0.8)


def test_a_steady_queue_or_a_single_waiting_request_projects_nothing_new():
    # chat requests queued at their usual cost: the projection is about the served rate
    steady = after_shift(num_waiting=1.0, queued_tokens=300)
    assert incoming_prefill_tokens_per_s(steady, CFG) == pytest.approx(2100.0)
    # less than half a request waiting on the look-back mean: too little to price the arrivals by
    rare = after_shift(num_waiting=0.3, queued_tokens=2400)
    assert incoming_prefill_tokens_per_s(rare, CFG) == 2100.0
    assert decide([rare], 1, 0.0, PolicyState(), CFG).reason is Reason.HOLD


def test_an_overloaded_fleet_scales_at_once_and_a_merely_busy_one_waits_the_delay():
    over = after_shift(num_waiting=2.0, queued_tokens=16_000)        # load 3.6+ on one replica
    d = decide([over], 1, 10.0, PolicyState(), CFG)
    assert d.reason is Reason.UP_PREDICTED and d.target_replicas == d.up_target > 1
    waits = decide([over], 1, 10.0, PolicyState(), PolicyConfig(**BASE, overload_skips_delay=False))
    assert waits.reason is Reason.UP_PENDING and waits.target_replicas == 1
    # above the target utilization (0.8) but within the replica's capacity: the up delay filters noise
    busy = ReplicaSignals(**{**CHAT, "num_running": 40, "num_in_flight": 40})     # 40 / 48 + 0.1 = 0.94
    assert 0.8 < fleet_load([busy], CFG).load_units < 1.0
    first = decide([busy], 1, 10.0, PolicyState(), CFG)
    assert first.reason is Reason.UP_PENDING and first.target_replicas == 1
    later = decide([busy], 1, 12.0, first.state, CFG)
    assert later.reason is Reason.UP_PREDICTED and later.target_replicas == 2
