"""The online capacity model (issue 29): a replica's step costs learned from its own steps, R and C from them,
replicas of different speeds, the KV growth of young sequences, and a mix shift the request-count rule does
not see."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, decide, fleet_load, replica_capacity
from affinity_serve.autoscale.signals import ReplicaSignals, SignalRecorder, StepCostModel
from benchmarks.autoscale import RayDefaultPolicy

CFG = PolicyConfig(min_replicas=1, max_replicas=32, ttft_slo_s=1.0, tpot_slo_s=0.1, prefill_tokens_per_s=5000.0,
                   decode_seqs_per_replica=16.0, upscale_delay_s=0.0, headroom_z=0.0, trend_lead_s=0.0)
LOAD = dict(num_waiting=0, num_in_flight=0, num_queued_prefill_tokens=0, num_preemptions_total=0)


def synthetic_replica(base: float, per_prefill: float, per_ctx: float, seed: int = 0, noise: float = 0.02,
                      steps: int = 400) -> SignalRecorder:
    """A recorder fed `steps` steps of a replica whose step costs base + per_prefill x prefill tokens +
    per_ctx x context tokens, times lognormal noise (a GPU's jitter): chunked prefill in some steps, decode
    batches of 1-48 sequences of 200-3000 context tokens."""
    rng = np.random.default_rng(seed)
    rec = SignalRecorder()
    for i in range(steps):
        prefill = int(rng.integers(1, 2048)) if rng.random() < 0.3 else 0
        seqs = int(rng.integers(1, 48))
        ctx = seqs * int(rng.integers(200, 3000))
        step = (base + per_prefill * prefill + per_ctx * ctx) * rng.lognormal(0.0, noise)
        rec.on_step(i * 0.02, step, prefill, seqs, ctx)
    return rec


def test_step_costs_converge_on_a_synthetic_replica():
    rec = synthetic_replica(0.012, 80e-6, 30e-9)
    s = rec.snapshot(8.0, num_running=10, kv_cache_usage=0.3, **LOAD)
    assert s.step_base_s == pytest.approx(0.012, rel=0.05)
    assert s.prefill_s_per_token == pytest.approx(80e-6, rel=0.05)
    assert s.decode_s_per_context_token == pytest.approx(30e-9, rel=0.05)
    cap = replica_capacity(replace(s, max_num_seqs=4096), CFG)
    assert cap.prefill_tokens_per_s == pytest.approx(12_500, rel=0.05)       # 1 / 80 us, not the 5000 prior
    # the batch whose decode step fits the 0.1 s TPOT SLO at the replica's mean context
    expected = (0.1 - 0.012) / (30e-9 * s.mean_context_tokens)
    assert cap.tpot_seqs == pytest.approx(expected, rel=0.08)
    assert replica_capacity(replace(s, max_num_seqs=8), CFG).tpot_seqs == 8      # the engine's batch cap


def test_estimates_follow_the_replica_and_an_unobserved_coefficient_keeps_its_value():
    m = StepCostModel(max_steps=64)
    assert m.fit() == (0.0, 0.0, 0.0)                     # too few steps: unknown (the policy uses its priors)
    for i in range(64):
        m.add(i, 0.01 + 50e-6 * (i % 7) * 100 + 40e-9 * 1000 * (i % 5 + 1), (i % 7) * 100, i % 5 + 1,
              1000 * (i % 5 + 1))
    base, prefill, decode = m.fit()
    assert (base, prefill, decode) == pytest.approx((0.01, 50e-6, 40e-9), rel=1e-6)
    for i in range(64):                                   # decode-only steps on a device twice as slow per token
        m.add(100 + i, 0.01 + 80e-9 * 1000 * (i % 5 + 1), 0, i % 5 + 1, 1000 * (i % 5 + 1))
    base, prefill, decode = m.fit()
    assert decode == pytest.approx(80e-9, rel=1e-6)       # the window holds the new steps only
    assert prefill == pytest.approx(50e-6, rel=1e-6)      # no prefill in them: the last estimate stands


def test_no_step_reports_means_the_priors_and_online_off_ignores_reports():
    quiet = ReplicaSignals(num_running=4, kv_cache_usage=0.1)
    cap = replica_capacity(quiet, CFG)
    assert (cap.prefill_tokens_per_s, cap.tpot_seqs, cap.kv_growth) == (5000.0, 16.0, 1.0)
    learned = replace(quiet, prefill_s_per_token=1e-4, step_base_s=0.01, decode_s_per_context_token=1e-7,
                      mean_context_tokens=1000)
    assert replica_capacity(learned, CFG.model_copy(update=dict(online_capacity=False))).prefill_tokens_per_s == 5000.0
    assert replica_capacity(learned, CFG).prefill_tokens_per_s == pytest.approx(10_000)


def _prefilling(per_token_s: float) -> ReplicaSignals:
    return ReplicaSignals(num_running=2, kv_cache_usage=0.1, prefill_tokens_per_s=4000, step_base_s=0.01,
                          prefill_s_per_token=per_token_s, decode_s_per_context_token=40e-9,
                          mean_context_tokens=1000, num_recent_requests=10, ttft_p90_s=0.2, tpot_p90_s=0.02)


def test_replicas_of_different_speeds_size_the_fleet_by_the_mean_replica():
    fast, slow = _prefilling(50e-6), _prefilling(200e-6)        # 20k and 5k tokens/s
    homogeneous = fleet_load([fast] * 4, CFG)
    mixed = fleet_load([fast, fast, slow, slow], CFG)
    assert homogeneous.prefill_units == pytest.approx(16_000 / 20_000)
    assert mixed.prefill_units == pytest.approx(16_000 / 12_500)     # mean R of the four
    # the priors (5000 tokens/s) would take every replica for a slow one
    assert fleet_load([fast] * 4,
                      CFG.model_copy(update=dict(online_capacity=False))).prefill_units == pytest.approx(3.2)
    cfg = CFG.model_copy(update=dict(target_utilization=0.4, downscale_utilization=0.2))
    same, diff = (decide(f, 4, 0.0, PolicyState(), cfg) for f in ([fast] * 4, [fast, fast, slow, slow]))
    assert diff.load.decode_units == same.load.decode_units    # the same sequences, the same C
    assert same.target_replicas == 4 < diff.target_replicas == 5     # ceil((1.28 + 0.47) / 0.4)
    assert diff.target_replicas == int(np.ceil(diff.load.load_units / 0.4))


def test_young_sequences_after_an_output_shift_raise_the_kv_floor_and_lower_c():
    before = ReplicaSignals(num_running=20, kv_cache_usage=0.8, mean_context_tokens=600, mean_prompt_tokens=500,
                            mean_output_tokens=200, num_recent_requests=10, ttft_p90_s=0.2, tpot_p90_s=0.02)
    # long-form outputs start: the sequences that finished were 500 + 1600 tokens, the running ones are young
    after = replace(before, mean_output_tokens=1600, mean_context_tokens=650)
    assert replica_capacity(before, CFG).kv_growth == 1.0
    growth = replica_capacity(after, CFG).kv_growth
    assert growth == pytest.approx((500 + 800) / 650)
    b, a = fleet_load([before] * 2, CFG), fleet_load([after] * 2, CFG)
    assert a.kv_units == pytest.approx(b.kv_units * growth)
    assert b.decode_units == pytest.approx(40 / 16)               # C_kv = 0.85 x 40 / 1.6 = 21: the prior binds
    assert a.decode_units == pytest.approx(40 / (0.85 * 40 / (1.6 * growth)))      # C_kv = 10.6


def test_a_prompt_length_shift_scales_ours_out_and_not_the_request_count_rule():
    """Same requests in flight before and after (so Serve's rule, at any target, decides the same), but each
    prompt is 16x longer: the prefill work, and our target, go up."""
    def fleet(prefill_rate: float) -> list[ReplicaSignals]:
        return [ReplicaSignals(num_running=6, num_in_flight=6, kv_cache_usage=0.3, prefill_tokens_per_s=prefill_rate,
                               step_base_s=0.01, prefill_s_per_token=50e-6, decode_s_per_context_token=40e-9,
                               mean_context_tokens=800, max_num_seqs=64, num_recent_requests=20,
                               ttft_p90_s=0.3, tpot_p90_s=0.03, requests_per_s=3.0)] * 2
    short, long = fleet(3 * 500), fleet(3 * 8000)
    cfg = CFG.model_copy(update=dict(headroom_z=2.0))
    ours = [decide(f, 2, 0.0, PolicyState(), cfg).target_replicas for f in (short, long)]
    assert ours[0] <= 2 < ours[1]
    for target in (2, 4, 8):
        serve = [RayDefaultPolicy(target, 1, 32, 0.0, 0.0, 5.0, 1.0, "serve", "serve").decide(
            sum(s.num_in_flight for s in f), 2, 0.0) for f in (short, long)]
        assert serve[0] == serve[1]
