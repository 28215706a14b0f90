"""A real LLMReplica (tiny llama, no Serve) reports the autoscaler's signals from its own streams."""
from __future__ import annotations

import pytest

from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.autoscale.signals import METRIC_KEYS, ReplicaSignals
from affinity_serve.engine import SamplingParams


async def test_replica_reports_recent_ttft_tpot_and_prefill_tokens(checkpoints):
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica({"model": checkpoints["llama"], "cache": {"num_blocks": 32, "block_size": 4}})
    before = rep.record_autoscaling_stats()
    assert set(before) == set(METRIC_KEYS) and all(isinstance(v, float) for v in before.values())
    assert before["num_recent_requests"] == 0.0
    prompt = list(range(5, 17))                                    # 12 tokens, 3 full blocks
    for rid in ("a", "b"):                                         # "b" hits the cache of "a"
        chunks = [c async for c in rep.generate(GenerateRequest(rid, prompt, SamplingParams(max_tokens=4,
                                                                                             temperature=0)))]
        assert chunks[-1].finish_reason == "length"
    s = ReplicaSignals.from_metrics(rep.record_autoscaling_stats())
    assert s.num_recent_requests == 2 and s.num_running == 0 and s.num_in_flight == 0
    assert 0 < s.ttft_p90_s < 30 and 0 < s.tpot_p90_s < 30
    cached = chunks[-1].num_cached_tokens
    assert cached > 0
    # uncached prompt tokens over the window (at most 10 s old here): 12 + (12 - cached)
    assert s.prefill_tokens_per_s * rep.signals.window_s >= 24 - cached - 1e-6


async def test_replica_reports_refills_of_what_the_router_saw_cached_elsewhere(checkpoints):
    """The router says another replica holds 8 of the 12 prompt tokens (and this one 4, wrongly): this
    (empty) replica recomputes all 12, 8 of them a refill; a repeat here hits its own cache and refills
    nothing."""
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica({"model": checkpoints["llama"], "cache": {"num_blocks": 32, "block_size": 4}})
    prompt = list(range(30, 42))
    for rid in ("moved", "repeat"):
        req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0),
                              cached_on=[(rep.replica_id, 4), ("another", 8)])
        chunks = [c async for c in rep.generate(req)]
    assert chunks[-1].num_cached_tokens == 8                     # the repeat hit the first's full blocks
    s = ReplicaSignals.from_metrics(rep.record_autoscaling_stats())
    span = rep.signals.window_s / 2             # the rates' shortest span: both requests are seconds old
    assert s.refill_tokens_per_s * span == pytest.approx(8.0)
    assert s.prefill_tokens_per_s * span == pytest.approx(12 + 4)
