"""Per-pool autoscaling for P/D (autoscale/pools.py): the prefill pool scales on prefill backlog against the TTFT
SLO, the decode pool on running sequences, KV usage and TPOT; each ignores the other pool's signals. Decisions
from tables of signals, and the Serve adapter on a real AutoscalingContext."""
from __future__ import annotations

import pytest

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, Reason, decide
from affinity_serve.autoscale.pools import Pool, PoolPolicy, decide_pool, pool_signals
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_serve_policy import KW, ctx

# 1000 uncached prompt tokens/s and 10 decoding sequences fill one replica; TTFT SLO 1 s, TPOT 0.1 s
CFG = PolicyConfig(min_replicas=1, max_replicas=8, ttft_slo_s=1.0, tpot_slo_s=0.1, prefill_tokens_per_s=1000,
                   decode_seqs_per_replica=10, kv_usage_target=0.85, target_utilization=0.8,
                   downscale_utilization=0.5, upscale_delay_s=0.0, downscale_delay_s=10.0, slo_cooldown_s=5.0,
                   headroom_z=0.0, trend_lead_s=0.0)
NOW = 1000.0
OK = dict(ttft_p90_s=0.3, tpot_p90_s=0.03, num_recent_requests=20)


def sig(running=0.0, waiting=0.0, queued_tokens=0.0, rate=0.0, kv=0.1, **kw) -> S:
    return S(num_running=running, num_waiting=waiting, num_in_flight=running + waiting,
             num_queued_prefill_tokens=queued_tokens, prefill_tokens_per_s=rate, kv_cache_usage=kv, **{**OK, **kw})


CASES = [
    # id, pool, signals, current, queued at callers, expected target, expected reason
    ("prefill: backlog within the TTFT SLO predicts 4", Pool.PREFILL, [sig(1, 5, queued_tokens=3000)], 1, 0, 4,
     Reason.UP_PREDICTED),
    ("prefill: TTFT breach doubles", Pool.PREFILL, [sig(1, ttft_p90_s=3.0)] * 2, 2, 0, 4, Reason.UP_SLO),
    # the prefill pool's in-flight prefills and the KV it holds for readers are no decode load; no TPOT
    ("prefill: running, held KV and TPOT are not its load", Pool.PREFILL,
     [sig(9, kv=0.95, tpot_p90_s=0.5, rate=300)] * 2, 2, 0, 2, Reason.HOLD),
    ("decode: the same running and KV are", Pool.DECODE, [sig(9, kv=0.95, rate=300)] * 2, 2, 0, 4,
     Reason.UP_PREDICTED),
    ("decode: TPOT breach x1.5", Pool.DECODE, [sig(1, tpot_p90_s=0.15)] * 4, 4, 0, 6, Reason.UP_SLO),
    ("decode: KV usage floor", Pool.DECODE, [sig(1, kv=0.95)] * 2, 2, 0, 3, Reason.UP_PREDICTED),
    # its first tokens come from the prefill pool: the TTFT it measures is not the client's
    ("decode: its TTFT is not the client's", Pool.DECODE, [sig(1, ttft_p90_s=3.0)] * 2, 2, 0, 2,
     Reason.DOWN_PENDING),
    ("decode: requests queued at the ingress are decodes", Pool.DECODE, [sig(9)], 1, 9, 3, Reason.UP_PREDICTED),
    # queued at the decode replicas' handles: 10 requests x 500 uncached tokens within 1 s = 5 replicas' prefill
    ("prefill: requests queued at decode replicas are prefill backlog", Pool.PREFILL,
     [sig(1, rate=1000, requests_per_s=2.0)], 1, 10, 8, Reason.UP_PREDICTED),
    ("prefill: from zero, a queued request starts it", Pool.PREFILL, [], 0, 3, 1, Reason.COLD_START),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pool_decision(case):
    _, pool, signals, current, queued, target, reason = case
    d = decide_pool(signals, current, NOW, PolicyState(), CFG, pool, num_queued_at_callers=queued)
    assert (d.target_replicas, d.reason) == (target, reason), d.describe()


def test_prefill_signals_keep_the_prefill_terms_and_drop_the_decode_ones():
    s = sig(7, 3, queued_tokens=1200, rate=800, kv=0.9, tpot_p90_s=0.4, preemptions_per_s=0.5)
    [p], queued = pool_signals([s], Pool.PREFILL, 0.0)
    assert (p.num_running, p.kv_cache_usage, p.tpot_p90_s) == (0.0, 0.0, 0.0)
    assert (p.num_queued_prefill_tokens, p.prefill_tokens_per_s, p.ttft_p90_s, p.preemptions_per_s) == (
        1200, 800, 0.3, 0.5)
    assert queued == 0.0
    load = decide([p], 1, NOW, PolicyState(), CFG).load
    assert load.decode_units == 0.0 and load.kv_units == 0.0 and load.prefill_units == pytest.approx(2.0)


def test_the_unified_rule_would_have_counted_the_prefill_pools_prefills_as_decodes():
    """Why the pool view matters: the same prefill replicas under the plain rule scale out on their KV holds."""
    signals = [sig(9, kv=0.95, rate=300)] * 2
    assert decide(signals, 2, NOW, PolicyState(), CFG).target_replicas == 4
    assert decide_pool(signals, 2, NOW, PolicyState(), CFG, Pool.PREFILL).target_replicas == 2


def test_serve_adapter_takes_the_pool_and_decides_on_its_view():
    m = {0: {"num_running": 9.0, "kv_cache_usage": 0.95, "num_queued_prefill_tokens": 0.0}}
    prefill, decode = PoolPolicy(pool="prefill", **KW), PoolPolicy(pool="decode", **KW)
    assert prefill(ctx(m, 1))[0] == 1               # nine prefills in flight are no decode load
    target, state = decode(ctx(m, 1))
    assert target == 2 and state["reason"] == "up_predicted"
    with pytest.raises(ValueError):
        PoolPolicy(pool="both", **KW)
