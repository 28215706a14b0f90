"""build_app is the one place that sets Serve options: check what it sets."""
from affinity_serve.app.builder import ingress_deployment, replica_deployment
from affinity_serve.app.config import AppConfig


def _cfg(**kw):
    return AppConfig.model_validate({"engine": {"model": "/m", **kw.pop("engine", {})}, **kw})


def test_cpu_replica_options():
    d = replica_deployment(_cfg(serve={"num_replicas": 3, "replica_num_cpus": 0.5, "max_ongoing_requests": 7,
                                       "max_queued_requests": 9, "graceful_shutdown_timeout_s": 12}))
    assert d.num_replicas == 3 and d.ray_actor_options["num_cpus"] == 0.5
    assert "num_gpus" not in d.ray_actor_options
    assert d.max_ongoing_requests == 7 and d.max_queued_requests == 9
    assert d._deployment_config.graceful_shutdown_timeout_s == 12


def test_gpu_replicas_request_one_gpu_each():
    d = replica_deployment(_cfg(engine={"device": "cuda"}))
    assert d.ray_actor_options["num_gpus"] == 1.0
    d = replica_deployment(_cfg(serve={"replica_num_gpus": 1}))
    assert d.ray_actor_options["num_gpus"] == 1


def test_autoscaling_replaces_fixed_replicas():
    d = replica_deployment(_cfg(autoscaling={"enabled": True, "min_replicas": 1, "max_replicas": 4},
                                serve={"num_replicas": 2}))
    ac = d._deployment_config.autoscaling_config
    assert ac.min_replicas == 1 and ac.max_replicas == 4 and ac.initial_replicas == 2


def test_ingress_binds_loopback_by_default_and_is_cpu_only():
    cfg = _cfg()
    assert cfg.serve.host == "127.0.0.1"
    d = ingress_deployment(cfg)
    assert d.ray_actor_options["num_cpus"] == 0.0 and "num_gpus" not in d.ray_actor_options


def test_replicas_are_routed_by_the_affinity_router_with_json_kwargs_from_the_config():
    import json

    from affinity_serve.app.builder import router_kwargs
    from affinity_serve.app.config import RoutingSection
    cfg = _cfg(engine={"cache": {"block_size": 8}},
               routing={"policy": "round_robin", "kv_events_period_s": 0.5, "affinity": {"release_slack": 0.5}})
    rc = replica_deployment(cfg)._deployment_config.request_router_config
    assert rc.request_router_class.endswith("serve_router.AffinityRequestRouter")
    kw = router_kwargs(cfg)
    assert json.loads(json.dumps(kw)) == kw == rc.request_router_kwargs
    assert kw["block_size"] == 8 and RoutingSection.model_validate(kw["routing"]) == cfg.routing
    assert kw["routing"]["policy"] == "round_robin" and kw["routing"]["affinity"]["release_slack"] == 0.5


def test_build_app_binds_the_validated_config_sections_themselves():
    """The typed hand-off (docs/architecture.md): the deployments receive the pydantic sections, not dicts
    validated again on the other side, and they survive Ray's pickling unchanged; the API key is bound
    nowhere (the ingress gets its digest)."""
    import inspect

    from ray import cloudpickle

    from affinity_serve.app.builder import build_app
    from affinity_serve.app.config import AutoscalingSection, ObservabilitySection, ServeSection
    from affinity_serve.app.http import APIKeyDigest
    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.engine import EngineConfig
    cfg = _cfg(serve={"api_key": "sk-test", "wedge_timeout_s": 7.0}, observability={"traces": "none"})
    ingress = build_app(cfg)._bound_deployment
    replica_app, app_config, digest = ingress.init_args
    assert type(app_config) is AppConfig and app_config.serve.api_key is None
    assert isinstance(digest, APIKeyDigest)
    engine, serve_section, obs = replica_app._bound_deployment.init_args
    assert type(engine) is EngineConfig and engine == cfg.engine.to_engine_config()
    assert type(serve_section) is ServeSection and serve_section.wedge_timeout_s == 7.0
    assert serve_section.api_key is None and serve_section == app_config.serve
    assert type(obs) is ObservabilitySection and obs.traces == "none"
    autoscaling = replica_app._bound_deployment.init_kwargs["autoscaling"]
    assert type(autoscaling) is AutoscalingSection and autoscaling == app_config.autoscaling
    for arg in (engine, serve_section, obs, app_config, autoscaling):
        assert cloudpickle.loads(cloudpickle.dumps(arg)) == arg
    # the replica keeps no defaults of its own: a section left out is that section's defaults
    defaults = [p.default for p in inspect.signature(LLMReplica).parameters.values()]
    assert defaults == [inspect.Parameter.empty, None, None, None]


async def test_the_autoscaling_signal_window_reaches_each_replicas_recorder(checkpoints):
    """autoscaling.signal_window_s (default 10 s) is the look-back of the SignalRecorder a replica reports to the
    autoscaler from: build_app binds the section to the replica (each P/D pool its own), which builds its
    recorder with it, and a request's first token leaves the reported signals that long after it."""
    import time

    from affinity_serve.app.builder import build_app, disagg_deployments
    from affinity_serve.app.config import AutoscalingSection
    from affinity_serve.app.protocol import GenerateRequest
    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.engine import EngineConfig, SamplingParams
    assert AutoscalingSection().signal_window_s == 10.0
    cfg = _cfg(autoscaling={"enabled": True, "signal_window_s": 2.5})
    section = build_app(cfg)._bound_deployment.init_args[0]._bound_deployment.init_kwargs["autoscaling"]
    assert section.signal_window_s == 2.5
    pd = AppConfig.model_validate({
        "engine": {"model": "/m", "cache": {"block_size": 4}},
        "autoscaling": {"enabled": True, "signal_window_s": 4.0},
        "disaggregation": {"enabled": True, "prefill": {"autoscaling": {"signal_window_s": 1.5}}}})
    decode = disagg_deployments(pd, pd.engine.to_engine_config())._bound_deployment
    prefill = decode.init_args[3]._bound_deployment
    assert decode.init_kwargs["autoscaling"].signal_window_s == 4.0
    assert prefill.init_kwargs["autoscaling"].signal_window_s == 1.5

    engine = EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 32, "block_size": 4})
    rep = LLMReplica(engine, autoscaling=section)
    try:
        assert rep.signals.window_s == 2.5
        t0 = time.monotonic()
        [c async for c in rep.generate(GenerateRequest("w", [5, 6, 7, 8], SamplingParams(max_tokens=2)))]
        t1 = time.monotonic()
        assert rep.record_autoscaling_stats()["num_recent_requests"] == 1
        load = dict(num_running=0, num_waiting=0, num_in_flight=0, kv_cache_usage=0.0, num_queued_prefill_tokens=0,
                    num_preemptions_total=0)
        # the request is recorded at some time within [t0, t1] (its first token: late on a loaded machine):
        # inside a 2.5 s window until t0 + 2.4 whenever it came, outside it from t1 + 2.6 (not so at 10 s)
        assert rep.signals.snapshot(t0 + 2.4, **load).num_recent_requests == 1
        assert rep.signals.snapshot(t1 + 2.6, **load).num_recent_requests == 0
    finally:
        await rep.engine.shutdown()
    plain = LLMReplica(engine)
    try:
        assert plain.signals.window_s == 10.0            # no autoscaling section: the section's default
    finally:
        await plain.engine.shutdown()


def test_the_engine_policys_config_is_defined_once_and_embedded_by_the_autoscaling_section():
    """autoscale.policy.PolicyConfig is the pydantic model the autoscaling section extends (its fields are
    declared there only); it crosses to Serve's controller as JSON kwargs and comes back equal."""
    import json

    from affinity_serve.app.builder import engine_policy_kwargs
    from affinity_serve.app.config import AutoscalingSection
    from affinity_serve.autoscale.policy import PolicyConfig
    from affinity_serve.autoscale.serve_policy import EngineAwarePolicy
    assert issubclass(AutoscalingSection, PolicyConfig)
    assert AppConfig.model_fields["autoscaling"].annotation is AutoscalingSection
    declared_elsewhere = {name for klass in AutoscalingSection.__mro__ if klass is not PolicyConfig
                          for name in vars(klass).get("__annotations__", {})}
    assert "enabled" in declared_elsewhere and not declared_elsewhere & set(PolicyConfig.model_fields)
    cfg = _cfg(autoscaling={"enabled": True, "max_replicas": 6, "ttft_slo_s": 1.5, "refill_weight": 0.25})
    kwargs = engine_policy_kwargs(cfg)
    assert json.loads(json.dumps(kwargs)) == kwargs and set(kwargs) == set(PolicyConfig.model_fields)
    policy = EngineAwarePolicy(**kwargs)
    assert type(policy.config) is PolicyConfig
    assert policy.config == PolicyConfig.model_validate(cfg.autoscaling.model_dump(include=set(kwargs)))
    assert (policy.config.max_replicas, policy.config.ttft_slo_s, policy.config.refill_weight) == (6, 1.5, 0.25)
