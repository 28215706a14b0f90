"""A replica's SignalRecorder: recent TTFT/TPOT p90, prefill rate and preemption rate over its window."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.signals import METRIC_KEYS, ReplicaSignals, SignalRecorder, refilled_tokens

LOAD = dict(num_running=2, num_waiting=1, num_in_flight=3, kv_cache_usage=0.4, num_queued_prefill_tokens=50)


def test_recent_window_drops_old_samples_and_computes_rates():
    r = SignalRecorder(window_s=10.0)
    r.snapshot(0.0, **LOAD, num_preemptions_total=0)
    for i in range(10):                          # a steady 1 req/s
        r.on_first_token(0.5 + i, ttft_s=0.1 * (i + 1), num_uncached_prompt_tokens=100)
        r.on_finished(0.5 + i, decode_s=0.9, num_output_tokens=10)
    s = r.snapshot(10.0, **LOAD, num_preemptions_total=5)
    assert s.num_recent_requests == 10 and s.requests_per_s == pytest.approx(1.0)
    assert s.ttft_p90_s == pytest.approx(0.91)
    assert s.tpot_p90_s == pytest.approx(0.1)
    assert s.prefill_tokens_per_s == pytest.approx(100.0)
    assert s.preemptions_per_s == pytest.approx(0.5)
    later = r.snapshot(30.0, **LOAD, num_preemptions_total=5)      # every sample older than 10 s
    assert (later.num_recent_requests, later.ttft_p90_s, later.prefill_tokens_per_s) == (0, 0.0, 0.0)
    assert later.preemptions_per_s == 0.0


def test_metrics_round_trip_and_are_numbers_only():
    s = ReplicaSignals(num_running=3, ttft_p90_s=0.5)
    m = s.to_metrics()
    assert set(m) == set(METRIC_KEYS) and all(isinstance(v, float) for v in m.values())
    assert ReplicaSignals.from_metrics({**m, "unknown": 1.0}) == s


def test_single_token_outputs_have_no_tpot_and_window_must_be_positive():
    r = SignalRecorder()
    r.on_finished(1.0, decode_s=0.0, num_output_tokens=1)
    assert r.snapshot(1.0, **LOAD, num_preemptions_total=0).tpot_p90_s == 0.0
    with pytest.raises(ValueError):
        SignalRecorder(window_s=0)


def test_refills_are_the_recomputed_tokens_the_fleet_held_and_are_reported_apart():
    other = [("b", 64)]
    assert refilled_tokens(100, 0, other, "a") == 64          # all of b's prefix recomputed on a
    assert refilled_tokens(100, 32, other, "a") == 32         # half of it was already on a
    assert refilled_tokens(100, 64, other, "a") == 0          # a held it too
    assert refilled_tokens(50, 0, other, "a") == 50           # never more than the prompt
    assert refilled_tokens(100, 0, None, "a") == 0 and refilled_tokens(100, 0, [], "a") == 0   # no prediction
    # what the index thought `a` held itself is an eviction, not a refill: only the best of the others counts
    assert refilled_tokens(100, 0, [("a", 80), ("b", 48)], "a") == 48
    assert refilled_tokens(100, 0, [("a", 80)], "a") == 0
    r = SignalRecorder(window_s=10.0)
    r.on_first_token(1.0, 0.1, num_uncached_prompt_tokens=100, num_refilled_tokens=60)
    r.on_first_token(2.0, 0.1, num_uncached_prompt_tokens=100)
    r.on_first_token(3.0, 0.1, num_uncached_prompt_tokens=10, num_refilled_tokens=40)   # capped at 10
    s = r.snapshot(5.0, **LOAD, num_preemptions_total=0)         # 3 arrivals, the oldest 4 s old: 16/3 s
    assert s.prefill_tokens_per_s == pytest.approx(210 * 3 / 16)
    assert s.refill_tokens_per_s == pytest.approx(70 * 3 / 16)
    r.snapshot(100.0, **LOAD, num_preemptions_total=0)           # the window has moved on; the totals stay
    assert r.totals == {"num_first_tokens": 3, "uncached_prompt_tokens": 210, "refilled_tokens": 70}


def test_rates_cover_the_time_since_the_oldest_first_token_and_at_least_half_the_window():
    """A stream that started after an idle spell reads at its own rate, not diluted by the idle part of the
    window; a replica's first requests do not read as a burst (half the window at least); a steady stream
    reads over the whole window."""
    r = SignalRecorder(window_s=10.0)
    for i in range(8):                                # 2 req/s from t = 100 s, after a long idle spell
        r.on_first_token(100.0 + 0.5 * i, 0.1, num_uncached_prompt_tokens=50)
    assert r.snapshot(104.0, **LOAD, num_preemptions_total=0).requests_per_s == pytest.approx(8 / 5)   # floor
    for i in range(8, 16):
        r.on_first_token(100.0 + 0.5 * i, 0.1, num_uncached_prompt_tokens=50)
    s = r.snapshot(108.0, **LOAD, num_preemptions_total=0)     # 16 over 8 s x 17/16: within 10% of 2/s
    assert s.requests_per_s == pytest.approx(16 / 8.5) and s.prefill_tokens_per_s == pytest.approx(800 / 8.5)
    assert s.requests_per_s == pytest.approx(2.0, rel=0.1)       # whole window: 1.6, 20% low
    for i in range(16, 60):
        r.on_first_token(100.0 + 0.5 * i, 0.1, num_uncached_prompt_tokens=50)
    assert r.snapshot(130.0, **LOAD, num_preemptions_total=0).requests_per_s == pytest.approx(20 / 10)
    one = SignalRecorder(window_s=10.0)
    one.on_first_token(50.0, 0.1, num_uncached_prompt_tokens=50)
    assert one.snapshot(50.1, **LOAD, num_preemptions_total=0).requests_per_s == pytest.approx(1 / 5)
