"""The disaggregation section: validation with messages that say what to change, and the two pools'
deployments and engine configs as build_app makes them."""
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
    ({"autoscaling": {"enabled": True}}, "per-pool autoscaling is not implemented yet"),
    ({"engine": {"kv_connector": {"type": "offload"}}}, "cannot be combined"),
    ({"engine": {"cache": {"enable_prefix_caching": False}}}, "enable_prefix_caching"),
    ({"disaggregation": {"enabled": True, "prefill": {"engine": {"scheduler": {"max_num_seqs": 0}}}}},
     "disaggregation.prefill.engine"),
    ({"disaggregation": {"enabled": True, "decode": {"replicas": 2}}}, "disaggregation.decode.replicas"),
])
def test_bad_disaggregation_configs_say_what_to_change(data, problem):
    data = {"disaggregation": {"enabled": True}, **data}
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        AppConfig.from_dict(data)
