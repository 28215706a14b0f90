"""The disaggregation section: validation with messages that say what to change, and the two pools'
deployments and engine configs as build_app makes them."""
import re

import pytest

from affinity_serve.app.builder import disagg_deployments
from affinity_serve.app.config import AppConfig, ConfigError


def _cfg(**d):
    return AppConfig.model_validate({"engine": {"model": "/m", "cache": {"block_size": 4}},
                                     "disaggregation": {"enabled": True, **d}})


def test_pools_get_their_engine_overrides_and_the_pd_connector():
    cfg = _cfg(transfer_timeout_s=7.0, min_remote_prefill_tokens=64,
               prefill={"num_replicas": 2, "engine": {"scheduler": {"max_num_batched_tokens": 8192}},
                        "replica_resources": {"prefill_slot": 1}},
               decode={"num_replicas": 3, "engine": {"scheduler": {"max_num_seqs": 256}}})
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    d_cfg, serve_section, obs, prefill_app, disagg = decode.init_args
    prefill = prefill_app._bound_deployment
    assert decode.name == "LLMReplica" and decode.num_replicas == 3 and disagg.min_remote_prefill_tokens == 64
    assert (serve_section, obs, disagg) == (cfg.serve, cfg.observability, cfg.disaggregation)
    assert prefill.name == "PrefillReplica" and prefill.num_replicas == 2
    assert prefill.ray_actor_options["resources"] == {"prefill_slot": 1}
    assert decode.ray_actor_options.get("resources", {}) == {}
    assert d_cfg.kv_connector.type == "pd" and d_cfg.kv_connector.transfer_timeout_s == 7.0
    assert d_cfg.scheduler.max_num_seqs == 256 and d_cfg.cache.block_size == 4
    p_cfg = prefill.init_args[0]
    assert p_cfg.scheduler.max_num_batched_tokens == 8192 and p_cfg.kv_connector.type == "pd"
    assert p_cfg.scheduler.max_num_seqs == 128          # the decode pool's override stays there


@pytest.mark.parametrize("data, problem", [
    ({"autoscaling": {"enabled": True}, "disaggregation": {"enabled": True, "decode": {"autoscaling": {
        "tpot_slo": 0.05}}}}, "disaggregation.decode.autoscaling.tpot_slo: unknown key (did you mean 'tpot_slo_s'?)"),
    ({"autoscaling": {"enabled": True}, "disaggregation": {"enabled": True, "prefill": {"autoscaling": {
        "min_replicas": 4, "max_replicas": 2}}}}, "disaggregation.prefill.autoscaling: .*max_replicas"),
    ({"autoscaling": {"enabled": True, "max_replicas": 2}, "disaggregation": {"enabled": True, "decode": {
        "num_replicas": 5}}}, "disaggregation.decode.num_replicas: 5 is outside this pool's autoscaling bounds [1, 2]"),
    ({"engine": {"kv_connector": {"type": "offload"}}}, "cannot be combined"),
    ({"engine": {"cache": {"enable_prefix_caching": False}}}, "enable_prefix_caching"),
    ({"disaggregation": {"enabled": True, "prefill": {"engine": {"scheduler": {"max_num_seqs": 0}}}}},
     "disaggregation.prefill.engine.scheduler.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
    ({"disaggregation": {"enabled": False, "prefill": {"engine": {"cache": {"blok_size": 16}}}}},
     "disaggregation.prefill.engine.cache.blok_size: unknown key (did you mean 'block_size'?)"),
    ({"disaggregation": {"enabled": False, "decode": {"autoscaling": {"max_replica": 3}}}},
     "disaggregation.decode.autoscaling.max_replica: unknown key (did you mean 'max_replicas'?)"),
    ({"disaggregation": {"enabled": True, "decode": {"replicas": 2}}}, "disaggregation.decode.replicas"),
    ({"disaggregation": {"enabled": True, "same_node_slack_requests": -1}},
     "disaggregation.same_node_slack_requests: Input should be greater than or equal to 0"),
])
def test_bad_disaggregation_configs_say_what_to_change(data, problem):
    data = {"disaggregation": {"enabled": True}, **data}
    with pytest.raises(ConfigError, match=".*".join(re.escape(part) for part in problem.split(".*"))):
        AppConfig.from_dict(data)


def test_each_pool_autoscales_on_its_own_signals_with_its_own_settings():
    """autoscaling.enabled with disaggregation: each pool is a Serve autoscaling deployment decided by
    autoscale.pools.PoolPolicy for that pool, with the app's autoscaling settings and the pool's laid over them."""
    cfg = AppConfig.model_validate({
        "engine": {"model": "/m", "cache": {"block_size": 4}},
        "autoscaling": {"enabled": True, "max_replicas": 6, "ttft_slo_s": 1.5, "tpot_slo_s": 0.1},
        "disaggregation": {"enabled": True,
                           "prefill": {"num_replicas": 2, "autoscaling": {"max_replicas": 3}},
                           "decode": {"num_replicas": 3, "autoscaling": {"min_replicas": 2, "tpot_slo_s": 0.05}}}})
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    prefill = decode.init_args[3]._bound_deployment
    for dep, pool, lo, hi, initial, tpot in ((prefill, "prefill", 1, 3, 2, 0.1), (decode, "decode", 2, 6, 3, 0.05)):
        a = dep._deployment_config.autoscaling_config
        assert (a.min_replicas, a.max_replicas, a.initial_replicas) == (lo, hi, initial)
        assert a.policy.policy_function == "affinity_serve.autoscale.pools:PoolPolicy"
        kw = a.policy.policy_kwargs
        assert kw["pool"] == pool and kw["ttft_slo_s"] == 1.5 and kw["tpot_slo_s"] == tpot
        assert (a.upscale_delay_s, a.downscale_delay_s) == (0.0, 0.0)     # the policy's own delays only

    # the kwargs are what the controller builds the policy from
    from affinity_serve.autoscale.pools import Pool, PoolPolicy
    policy = PoolPolicy(**prefill._deployment_config.autoscaling_config.policy.policy_kwargs)
    assert policy.pool is Pool.PREFILL and policy.config.max_replicas == 3


def test_a_pool_can_stay_fixed_while_the_other_autoscales():
    cfg = AppConfig.model_validate({
        "engine": {"model": "/m", "cache": {"block_size": 4}}, "autoscaling": {"enabled": True, "max_replicas": 4},
        "disaggregation": {"enabled": True, "prefill": {"num_replicas": 2, "autoscaling": {"enabled": False}}}})
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    prefill = decode.init_args[3]._bound_deployment
    assert prefill.num_replicas == 2 and prefill._deployment_config.autoscaling_config is None
    assert decode._deployment_config.autoscaling_config.policy.policy_kwargs["pool"] == "decode"


def test_without_autoscaling_both_pools_stay_at_their_sizes():
    cfg = _cfg(prefill={"num_replicas": 2})
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    prefill = decode.init_args[3]._bound_deployment
    assert (prefill.num_replicas, decode.num_replicas) == (2, 1)
    assert prefill._deployment_config.autoscaling_config is None
    assert decode._deployment_config.autoscaling_config is None


def test_every_pool_problem_is_listed_at_once():
    data = {"autoscaling": {"enabled": True, "max_replicas": 2},
            "disaggregation": {"enabled": True, "prefill": {"num_replicas": 3},
                               "decode": {"engine": {"cache": {"blok_size": 8}}}}}
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict(data)
    assert e.value.problems == [
        "disaggregation.prefill.num_replicas: 3 is outside this pool's autoscaling bounds [1, 2] (it is the pool's "
        "initial size; change it or the bounds)",
        "disaggregation.decode.engine.cache.blok_size: unknown key (did you mean 'block_size'?)"]
