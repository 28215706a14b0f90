"""`kv_apart` (autoscale/policy.py): KV memory sizes the fleet on its own instead of being folded into the decode
load, where it would add to prefill's compute and get target_utilization on top of kv_usage_target."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from affinity_serve.autoscale.policy import PolicyState, decide, fleet_load
from affinity_serve.autoscale.signals import ReplicaSignals as S
from tests.unit.autoscale.test_policy import CFG, OK_LATENCY

NOW = 1000.0
#: learned costs: a decode step of 1,500-token contexts fits 60 sequences in the 0.1 s TPOT SLO (C_tpot = 60)
STEPS = dict(step_base_s=0.01, decode_s_per_context_token=1e-6, mean_context_tokens=1500.0, max_num_seqs=64)
APART = CFG.model_copy(update=dict(kv_apart=True))


def rep(running: float, kv: float, prefill_rate: float = 300.0) -> S:
    return S(num_running=running, num_in_flight=running, kv_cache_usage=kv, prefill_tokens_per_s=prefill_rate,
             **STEPS, **OK_LATENCY)


def test_a_kv_bound_fleet_is_sized_by_its_kv_not_by_kv_plus_prefill_over_the_utilization():
    """The base trace's burst in small: 4 replicas each holding 9 sequences in 80% of their KV, little compute."""
    fleet = [rep(9, 0.8)] * 4
    folded, apart = fleet_load(fleet, CFG), fleet_load(fleet, APART)
    # folded: C = min(60, C_kv = 0.85 x 36 / 3.2) = 9.56, so the decode load is the KV: 3.76 units
    assert folded.decode_units == pytest.approx(folded.kv_units) == pytest.approx(3.2 / 0.85)
    assert apart.decode_units == pytest.approx(36 / 60)          # the batch the TPOT SLO allows
    assert apart.kv_units == folded.kv_units and apart.prefill_units == folded.prefill_units == pytest.approx(1.2)
    # folded: (1.2 + 3.76) / 0.8 = 6.2 -> 7 replicas; apart: max((1.2 + 0.6) / 0.8, 3.76) -> 4, what it has
    assert decide(fleet, 4, NOW, PolicyState(), CFG).target_replicas == 7
    assert decide(fleet, 4, NOW, PolicyState(), APART).target_replicas == 4


def test_kv_still_scales_out_alone_and_a_compute_bound_fleet_decides_as_before():
    full = [rep(9, 0.95)] * 4                        # 4.47 units of KV: one replica more, for KV alone
    assert decide(full, 4, NOW, PolicyState(), APART).target_replicas == 5
    light_kv = [rep(9, 0.1, prefill_rate=800.0)] * 4     # C_kv does not bind (76 > 60): nothing changes
    assert fleet_load(light_kv, APART).decode_units == pytest.approx(fleet_load(light_kv, CFG).decode_units)
    assert (decide(light_kv, 4, NOW, PolicyState(), APART).target_replicas
            == decide(light_kv, 4, NOW, PolicyState(), CFG).target_replicas == 5)    # (3.2 + 0.6) / 0.8


def test_a_value_that_is_not_a_boolean_is_refused_naming_the_option():
    from affinity_serve.app.config import AppConfig, ConfigError
    with pytest.raises(ValidationError, match="kv_apart"):
        CFG.model_validate({**CFG.model_dump(), "kv_apart": "sometimes"})
    # through the app's YAML: one line naming the key and what it got
    with pytest.raises(ConfigError, match=r"autoscaling\.kv_apart: Input should be a valid boolean.*'sometimes'"):
        AppConfig.from_dict({"engine": {"model": "m"}, "autoscaling": {"enabled": True, "kv_apart": "sometimes"}})
    assert AppConfig.from_dict({"engine": {"model": "m"}, "autoscaling": {"enabled": True, "kv_apart": True}}
                               ).autoscaling.kv_apart is True


def test_the_cache_loss_floor_still_counts_a_kv_bound_batch_as_busy():
    """A prefix cache that stops hitting must be absorbed by replicas whose pools the running sequences fill:
    the floor (load + what the cache saves) takes the decode load folded with the KV, as without kv_apart.
    Measured: with the compute-only decode load there, the reuse-collapse trace lost 0.034 attainment at seeds
    0 and 1 (docs/autoscaling.md)."""
    import dataclasses
    fleet = [dataclasses.replace(rep(9, 0.8), prompt_tokens_per_s=600.0)] * 4     # the cache saves 1.2 units
    load = fleet_load(fleet, APART)
    assert load.cached_units == pytest.approx(1.2) and load.decode_units == pytest.approx(0.6)
    assert load.folded_decode_units == pytest.approx(3.2 / 0.85)
    # floor (trend lead 0: no slack): 1.2 prefill + 3.76 folded decode + 1.2 saved = 6.16 -> 7 replicas;
    # with the compute-only 0.6 it would be 3.0, below the KV's own 3.76 -> 4
    assert decide(fleet, 4, NOW, PolicyState(), APART).target_replicas == 7
