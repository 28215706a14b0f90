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
    ({"disaggregation": {"enabled": True, "local_prefill_slack_s": -0.5}},
     "disaggregation.local_prefill_slack_s: Input should be greater than or equal to 0"),
    ({"disaggregation": {"enabled": True, "local_prefill_slack_s": "soon"}},
     "disaggregation.local_prefill_slack_s: Input should be a valid number"),
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


@pytest.mark.parametrize("override, key", [
    ({"cache": {"block_size": 32}}, "cache.block_size"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"max_model_len": 512}, "max_model_len"),
    ({"model": "/other"}, "model"),
    ({"skip_tokenizer_init": True}, "skip_tokenizer_init"),
    ({"generation_config": "ignore"}, "generation_config"),
])
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_pool_cannot_set_what_both_pools_must_share(override, key, pool):
    """A per-pool block size, dtype, model, context length or tokenizer/sampling-default setting makes every
    transfer fail (or some prompts, or the first token differ) while P/D looks on: refused, naming the key and
    where to set it, even with disaggregation off (the pools are checked either way)."""
    for enabled in (True, False):
        with pytest.raises(ConfigError) as e:
            AppConfig.from_dict({"engine": {"model": "/m"},
                                 "disaggregation": {"enabled": enabled, pool: {"engine": override}}})
        assert len(e.value.problems) == 1
        assert e.value.problems[0].startswith(f"disaggregation.{pool}.engine.{key}: must be the same in both pools (")
        assert e.value.problems[0].endswith(f"set engine.{key} in the top-level engine section instead")


def test_every_shared_key_a_pool_sets_is_its_own_line():
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m"}, "disaggregation": {"enabled": True, "prefill": {"engine": {
            "cache": {"block_size": 32, "num_blocks": 64}, "dtype": "float16", "model": "/x",
            "scheduler": {"max_num_seqs": 0}}}}})
    assert [p.split(":")[0] for p in e.value.problems] == [
        "disaggregation.prefill.engine.model", "disaggregation.prefill.engine.dtype",
        "disaggregation.prefill.engine.cache.block_size", "disaggregation.prefill.engine.scheduler.max_num_seqs"]


def test_a_pool_cannot_set_its_kv_connector():
    """The pd connector is the builder's: a pool's kv_connector (its type, its transfer_timeout_s) used to be
    overwritten without a word."""
    for kv in ({"type": "offload"}, {"transfer_timeout_s": 5}):
        with pytest.raises(ConfigError) as e:
            AppConfig.from_dict({"engine": {"model": "/m"},
                                 "disaggregation": {"enabled": True, "decode": {"engine": {"kv_connector": kv}}}})
        [problem] = e.value.problems
        assert problem.startswith("disaggregation.decode.engine.kv_connector: not a per-pool setting")
        assert "disaggregation.transfer_timeout_s" in problem
    with pytest.raises(ConfigError, match=r"engine.kv_connector.transfer_timeout_s: 5 is not used with "
                                          r"disaggregation: set disaggregation.transfer_timeout_s"):
        AppConfig.from_dict({"engine": {"model": "/m", "kv_connector": {"transfer_timeout_s": 5}},
                             "disaggregation": {"enabled": True}})
    # the same value as disaggregation's is not a conflict, nor any value without disaggregation
    AppConfig.from_dict({"engine": {"model": "/m", "kv_connector": {"transfer_timeout_s": 5}},
                         "disaggregation": {"enabled": True, "transfer_timeout_s": 5}})
    AppConfig.from_dict({"engine": {"model": "/m", "kv_connector": {"transfer_timeout_s": 5}}})


def test_pools_on_different_devices_need_an_explicit_dtype():
    data = {"engine": {"model": "/m"}, "disaggregation": {"enabled": True, "prefill": {"engine": {"device": "cuda"}},
                                                          "decode": {"engine": {"device": "cpu"}}}}
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict(data)
    assert [p.split(":")[0] for p in e.value.problems] == ["disaggregation.prefill.engine.device",
                                                           "disaggregation.decode.engine.device"]
    assert "set engine.dtype explicitly" in e.value.problems[0]
    AppConfig.from_dict({**data, "engine": {"model": "/m", "dtype": "float32"}})
    # a named device beside the other pool's auto (cuda on a GPU node) is not refused
    AppConfig.from_dict({"engine": {"model": "/m"}, "disaggregation": {"enabled": True,
                                                                      "prefill": {"engine": {"device": "cuda"}}}})


def test_pool_overrides_that_keep_the_pools_compatible_are_accepted():
    cfg = _cfg(prefill={"engine": {"scheduler": {"max_num_batched_tokens": 8192}, "attention_backend": "torch",
                                   "cache": {"num_blocks": 64}, "enforce_eager": True, "num_threads": 2}},
               decode={"engine": {"scheduler": {"max_num_seqs": 256}, "cascade_min_tokens": None}})
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    p_cfg = decode.init_args[3]._bound_deployment.init_args[0]
    assert p_cfg.cache.num_blocks == 64 and p_cfg.cache.block_size == 4 and p_cfg.attention_backend == "torch"


def test_bounds_the_wrong_way_round_say_so_and_where_each_came_from():
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m"}, "autoscaling": {"enabled": True}, "disaggregation": {
            "enabled": True, "prefill": {"num_replicas": 2, "autoscaling": {"min_replicas": 4, "max_replicas": 2}}}})
    assert e.value.problems == [
        "disaggregation.prefill.autoscaling: min_replicas (4, set in this pool) is above max_replicas (2, set in "
        "this pool): raise max_replicas or lower min_replicas"]
    # not autoscaled, max_replicas inherited: the message says where the 2 comes from and what the bounds are for
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m"}, "disaggregation": {
            "enabled": True, "decode": {"num_replicas": 2, "autoscaling": {"min_replicas": 3}}}})
    [problem] = e.value.problems
    assert problem.startswith("disaggregation.decode.autoscaling: min_replicas (3, set in this pool) is above "
                              "max_replicas (2, inherited from autoscaling.max_replicas, its default): set this "
                              "pool's max_replicas too, or a lower min_replicas; this pool is not autoscaled")
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m"}, "autoscaling": {"max_replicas": 2}, "disaggregation": {
            "decode": {"autoscaling": {"min_replicas": 3}}}})
    assert "(2, inherited from autoscaling.max_replicas)" in e.value.problems[0]


def test_typos_at_every_level_are_reported_in_one_pass():
    """A pool's engine and autoscaling keys are checked once the sections they lie over are valid; an error
    elsewhere used to hide them until it was fixed."""
    data = {"engine": {"model": "/m"}, "serve": {"num_replica": 2},
            "disaggregation": {"enabled": True, "engin": {}, "min_remote_prefil_tokens": 3, "prefill": {
                "engine": {"scheduler": {"max_num_batched_token": 5}, "cache": {"block_size": 8}},
                "autoscaling": {"max_replica": 3}}}}
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict(data)
    assert [p.split(":")[0] for p in e.value.problems] == [
        "serve.num_replica", "disaggregation.engin", "disaggregation.min_remote_prefil_tokens",
        "disaggregation.prefill.engine.cache.block_size", "disaggregation.prefill.autoscaling.max_replica",
        "disaggregation.prefill.engine.scheduler.max_num_batched_token"]
    # an invalid engine section: the pool's own key problems still show, not those that depend on the section
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m", "cache": {"block_siz": 3}, "pace": {"step_base_s": 0.1}},
                             "disaggregation": {"prefill": {"engine": {"pace": {"enabled": True},
                                                                       "scheduler": {"max_num_seqs": 0}}}}})
    assert [p.split(":")[0] for p in e.value.problems] == [
        "engine.cache.block_siz", "disaggregation.prefill.engine.scheduler.max_num_seqs"]


def test_a_pool_bound_of_the_wrong_type_is_a_config_line_not_a_traceback():
    """A pool's max_replicas of null or "many" crashed the check (comparing it with an int: TypeError, exit 1);
    "3" is coerced, as at the top level."""
    base = {"engine": {"model": "/m"}, "autoscaling": {"enabled": True, "max_replicas": 2}}
    for value, problem in ((None, "disaggregation.decode.autoscaling.max_replicas: Input should be a valid integer"),
                           ("many", "disaggregation.decode.autoscaling.max_replicas: Input should be a valid integer")):
        with pytest.raises(ConfigError) as e:
            AppConfig.from_dict({**base, "disaggregation": {"enabled": True,
                                                            "decode": {"autoscaling": {"max_replicas": value}}}})
        assert e.value.problems[0].startswith(problem), e.value.problems
    cfg = AppConfig.from_dict({**base, "disaggregation": {"enabled": True,
                                                           "decode": {"autoscaling": {"max_replicas": "3"}}}})
    assert disagg_deployments(cfg, cfg.engine.to_engine_config()) is not None


def test_one_engine_id_for_every_replica_is_refused():
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m", "kv_connector": {"engine_id": "e1"}},
                             "disaggregation": {"enabled": True}})
    assert "engine.kv_connector.engine_id: 'e1' would name every replica of both pools alike" in str(e.value)


def test_transport_nixl_is_checked_and_reaches_both_pools(monkeypatch, tmp_path):
    """disaggregation.transport: a typo is refused with the choices; nixl without NIXL's package is one line saying
    what to install; with it, both pools' replicas are built with the section (their transport)."""
    import pytest as _pytest
    from pydantic import ValidationError

    from affinity_serve.app import config as app_config_mod
    from affinity_serve.app.config import AppConfig
    base = {"engine": {"model": str(tmp_path)}, "disaggregation": {"enabled": True}}
    with _pytest.raises(ValidationError, match="'ray' or 'nixl'"):
        AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "transport": "rdma"}})
    monkeypatch.setattr(app_config_mod, "nixl_installed", lambda: False)
    with _pytest.raises(ValidationError, match=r"pip install 'affinity-serve\[nixl\]'"):
        AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "transport": "nixl"}})
    monkeypatch.setattr(app_config_mod, "nixl_installed", lambda: True)
    cfg = AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "transport": "nixl",
                                                               "nixl_staging_mib": 8}})
    assert cfg.disaggregation.transport == "nixl" and cfg.disaggregation.nixl_staging_mib == 8
    with _pytest.raises(ValidationError, match="nixl_staging_mib"):
        AppConfig.model_validate({**base, "disaggregation": {"enabled": True, "nixl_staging_mib": 0}})


def test_make_transport_follows_the_section():
    from affinity_serve.app.disagg import make_transport
    from affinity_serve.app.disagg_config import DisaggregationSection, nixl_installed
    assert make_transport(None, object()) is None
    assert make_transport(DisaggregationSection(), object()) is None        # ray: the object store's
    if nixl_installed():
        class _E:
            woke = 0

            def wake_threadsafe(self):
                _E.woke += 1
        t = make_transport(DisaggregationSection(transport="nixl", nixl_staging_mib=2), _E())
        try:
            assert t.staging_bytes == 2 << 20
            t.on_hold_freed()
            assert _E.woke == 1
        finally:
            t.close()


def test_transport_nixl_needs_a_transfer_timeout_above_the_read_margin(monkeypatch, tmp_path):
    import pytest as _pytest
    from pydantic import ValidationError

    from affinity_serve.app import config as app_config_mod
    from affinity_serve.app.config import AppConfig
    monkeypatch.setattr(app_config_mod, "nixl_installed", lambda: True)
    with _pytest.raises(ValidationError, match="transfer_timeout_s .* must be above 1s with transport nixl"):
        AppConfig.model_validate({"engine": {"model": str(tmp_path)}, "disaggregation": {
            "enabled": True, "transport": "nixl", "transfer_timeout_s": 0.5}})


def test_the_ray_transport_refuses_another_transports_address_as_incompatible():
    """A decode replica on the object store given a prefill from a NIXL pool (mixed transports): a clean
    KVTransferError (it recomputes) and the span says incompatible, not a TypeError unpacking the address."""
    import pytest as _pytest

    from affinity_serve.app.disagg import RayObjectTransport
    from affinity_serve.engine import KVTransferError, RemotePrefill

    class NotARef:
        """An address of another transport's kind (a NixlAddress stands here)."""
    t = RayObjectTransport()
    remote = RemotePrefill("p", "tid", "key", 32, 4, 7, address=NotARef())
    with _pytest.raises(KVTransferError) as e:
        t.start_read(remote, 0, 4)
    assert e.value.cause == "error" and "transport" in str(e.value)
    assert t.take_record("tid").outcome == "incompatible"


def test_the_decode_pools_router_gets_every_routing_setting_of_the_section():
    """The ingress's PDDecodeRouter is built from its request_router_kwargs (Serve passes JSON only): a setting
    left out of them silently took its default there (local_prefill_slack_s did)."""
    cfg = _cfg(min_remote_prefill_tokens=64, local_prefill_slack_s=0.25, same_node_slack_s=0.5,
               same_node_slack_requests=3)
    decode = disagg_deployments(cfg, cfg.engine.to_engine_config())._bound_deployment
    kwargs = decode._deployment_config.request_router_config.request_router_kwargs
    assert kwargs["disaggregation"] == {"min_remote_prefill_tokens": 64, "local_prefill_slack_s": 0.25,
                                        "same_node_slack_s": 0.5, "same_node_slack_requests": 3}
