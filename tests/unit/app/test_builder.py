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
    cfg = _cfg(engine={"cache": {"block_size": 8}},
               routing={"policy": "round_robin", "kv_events_period_s": 0.5, "affinity": {"release_slack": 0.5}})
    rc = replica_deployment(cfg)._deployment_config.request_router_config
    assert rc.request_router_class.endswith("serve_router.AffinityRequestRouter")
    kw = router_kwargs(cfg)
    assert json.loads(json.dumps(kw)) == kw == rc.request_router_kwargs
    assert kw["policy"] == "round_robin" and kw["block_size"] == 8 and kw["kv_events_period_s"] == 0.5
    assert kw["affinity"]["release_slack"] == 0.5
