"""build_app: the only place that turns an AppConfig into Ray Serve deployment options."""
from __future__ import annotations

import json
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from affinity_serve.app.config import AppConfig, AutoscalingSection
from affinity_serve.app.http import APIKeyDigest
from affinity_serve.app.ingress import IngressServer
from affinity_serve.app.replica import LLMReplica
from affinity_serve.app.routing.serve_router import AffinityRequestRouter
from affinity_serve.engine import EngineConfig


def resolve_model(config: AppConfig) -> AppConfig:
    """Fill in the demo model directory when no model is configured (generated once, cached), and the served
    model name when a local path names its directory only relatively (`.`, `..`: the directory's own name)."""
    model = config.engine.model
    if model and config.serve.model_name is None and os.path.isdir(model):
        name = os.path.basename(os.path.abspath(model))       # abspath: "." and ".." resolved, links kept
        if name and name != os.path.basename(os.path.normpath(model)):
            config = config.model_copy(update={"serve": config.serve.model_copy(update={"model_name": name})})
    if model:
        return config
    from affinity_serve.engine import ensure_demo_model
    path = ensure_demo_model()
    return config.model_copy(update={"engine": config.engine.model_copy(update={"model": str(path)})})


def router_kwargs(config: AppConfig) -> dict[str, Any]:
    """AffinityRequestRouter.initialize_state's kwargs: the routing section as JSON (Serve ships a router's
    kwargs to every handle as JSON only; the router validates it back) and the engine's KV block size."""
    return {"routing": config.routing.model_dump(mode="json"), "block_size": config.engine.cache.block_size}


def replica_placement(config: AppConfig) -> dict[str, Any]:
    """Where model replicas run: a GPU each on GPU nodes (a CPU share on CPU nodes), the configured custom
    resources (a slot only worker nodes declare keeps them off the head), at most max_replicas_per_node each."""
    s = config.serve
    actor_opts: dict[str, Any] = {"num_cpus": s.replica_num_cpus}
    num_gpus = s.replica_num_gpus or (1.0 if config.engine.device == "cuda" else 0.0)
    if num_gpus:
        actor_opts["num_gpus"] = num_gpus     # one GPU per replica: each replica holds a full model copy
    if s.replica_resources:
        actor_opts["resources"] = dict(s.replica_resources)
    opts: dict[str, Any] = {"ray_actor_options": actor_opts}
    if s.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = s.max_replicas_per_node
    return opts


def serve_start_options(config: AppConfig) -> dict[str, Any]:
    """serve.start's kwargs: HTTP bound to serve.host:serve.port, proxies only where proxy_location says (the
    default HeadOnly keeps worker nodes from opening the HTTP port too)."""
    s = config.serve
    return {"proxy_location": s.proxy_location, "http_options": {"host": s.host, "port": s.port}}


def http_limits_env(config: AppConfig) -> dict[str, str]:
    """The environment under which Serve's proxy enforces the HTTP layer's limits (header size, body read
    time and size, requests in flight; Serve's client-hint headers removed): set where the proxy starts
    (the CLI sets it before it starts its local Ray; on a cluster, the nodes' environment, docs/limits.md)."""
    from affinity_serve.app.http import HTTP_LIMITS_ENV, PROXY_CALLBACK, PROXY_CALLBACK_ENV
    s = config.serve
    limits = {"max_header_bytes": s.max_header_bytes, "max_body_bytes": s.max_request_body_bytes,
              "body_read_timeout_s": s.body_read_timeout_s, "max_connections": s.max_connections,
              "max_connections_per_client": s.max_connections_per_client, "retry_after_s": s.retry_after_s}
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK, HTTP_LIMITS_ENV: json.dumps(limits)}


def ingress_placement(config: AppConfig) -> dict[str, Any]:
    """The ingress never asks for a GPU; custom resources (e.g. one only the head/CPU nodes declare) pin it."""
    s = config.serve
    actor_opts: dict[str, Any] = {"num_cpus": s.ingress_num_cpus}
    if s.ingress_resources:
        actor_opts["resources"] = dict(s.ingress_resources)
    return {"ray_actor_options": actor_opts}


def request_router_config(config: AppConfig, router_class: type = AffinityRequestRouter,
                          **extra_kwargs: Any) -> RequestRouterConfig:
    """Serve's RequestRouterConfig for a model deployment: `router_class` (a P/D pool's router subclass) with
    router_kwargs and `extra_kwargs` (JSON values)."""
    r = config.routing
    return RequestRouterConfig(
        request_router_class=router_class, request_router_kwargs={**router_kwargs(config), **extra_kwargs},
        request_routing_stats_period_s=r.request_routing_stats_period_s,
        request_routing_stats_timeout_s=r.request_routing_stats_timeout_s)


def replica_deployment(config: AppConfig):
    s = config.serve
    opts: dict[str, Any] = dict(
        name="LLMReplica",
        **replica_placement(config),
        max_ongoing_requests=s.max_ongoing_requests,
        max_queued_requests=s.max_queued_requests,
        graceful_shutdown_timeout_s=s.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=min(1.0, s.graceful_shutdown_timeout_s) or 0.1,
        health_check_period_s=s.health_check_period_s,
        health_check_timeout_s=s.health_check_timeout_s,
        request_router_config=request_router_config(config),
    )
    if config.autoscaling.enabled:
        opts["autoscaling_config"] = autoscaling_config(config)
    else:
        opts["num_replicas"] = s.num_replicas
    return serve.deployment(LLMReplica).options(**opts)


def disagg_deployments(config: AppConfig, engine: EngineConfig):
    """P/D disaggregation (app/disagg.py): the decode pool, bound to a handle on the prefill pool. Each pool is an
    LLMReplica deployment with its own router (prefix affinity on its own replicas' caches); the decode one keeps
    the name LLMReplica, as the ingress's target."""
    from affinity_serve.app.disagg import DecodeReplica, PrefillReplica
    from affinity_serve.app.disagg_config import pool_autoscaling, pool_engine_config
    from affinity_serve.app.disagg_router import PREFILL_DEPLOYMENT, PDDecodeRouter, PrefillPoolRouter
    d = config.disaggregation
    base = replica_deployment(config)
    obs = config.observability

    def pool_options(name: str, pool) -> dict[str, Any]:
        placement = replica_placement(config)["ray_actor_options"]
        if pool.replica_resources is not None:
            placement = {**placement, "resources": dict(pool.replica_resources)}
        scaling = pool_autoscaling(config.autoscaling, pool)
        if scaling.enabled:        # each pool on its own signals (autoscale/pools.py)
            return {"autoscaling_config": autoscaling_config(config, scaling, pool=name),
                    "ray_actor_options": placement}
        return {"num_replicas": pool.num_replicas, "autoscaling_config": None, "ray_actor_options": placement}

    # The ingress's router over the decode pool picks each request's prefill replica first (the prefill pool's
    # router in the ingress, on a handle it opens), then a decode replica near it (app/disagg_router.py).
    prefill = base.options(func_or_class=PrefillReplica, name=PREFILL_DEPLOYMENT, **pool_options("prefill", d.prefill),
                           request_router_config=request_router_config(config, PrefillPoolRouter))
    prefill_app = prefill.bind(pool_engine_config(engine, d.prefill, d), config.serve, obs,
                               autoscaling=pool_autoscaling(config.autoscaling, d.prefill), disaggregation=d)
    decode = base.options(func_or_class=DecodeReplica, name="LLMReplica", **pool_options("decode", d.decode),
                          request_router_config=request_router_config(
                              config, PDDecodeRouter, disaggregation=d.model_dump(mode="json", include={
                                  "min_remote_prefill_tokens", "local_prefill_slack_s", "same_node_slack_s",
                                  "same_node_slack_requests"})))
    prefill_scaling = pool_autoscaling(config.autoscaling, d.prefill)
    from affinity_serve.engine import derive_max_model_len
    return decode.bind(pool_engine_config(engine, d.decode, d), config.serve, obs, prefill_app, d,
                       autoscaling=pool_autoscaling(config.autoscaling, d.decode),
                       prefill_min_replicas=prefill_scaling.min_replicas if prefill_scaling.enabled
                       else d.prefill.num_replicas,
                       prefill_max_model_len=derive_max_model_len(pool_engine_config(engine, d.prefill, d)))


def engine_policy_kwargs(config: AppConfig, section: AutoscalingSection | None = None) -> dict[str, Any]:
    """The autoscaling section's PolicyConfig part as EngineAwarePolicy's kwargs: the one place the policy's
    config crosses as a dict, because Serve takes a custom policy's kwargs as JSON only (AutoscalingPolicy
    checks); the controller validates them back into a PolicyConfig (autoscale/serve_policy.py). `section`:
    a P/D pool's (disagg_config.pool_autoscaling), else the app's."""
    from affinity_serve.autoscale.policy import PolicyConfig
    return (section or config.autoscaling).model_dump(mode="json", include=set(PolicyConfig.model_fields))


def autoscaling_config(config: AppConfig, section: AutoscalingSection | None = None,
                       pool: str | None = None) -> dict[str, Any]:
    """Serve's autoscaling_config. policy `engine`: our EngineAwarePolicy decides, with Serve's own delays
    at 0 (Serve wraps every custom policy with its delays; ours already hold each direction for its delay,
    so two sets would add up); policy `requests`: Serve's default rule with our delays. `section` and `pool`:
    a P/D pool's autoscaling, decided by autoscale.pools.PoolPolicy on that pool's signals."""
    a, s = section or config.autoscaling, config.serve
    initial = a.initial_replicas if a.initial_replicas is not None else s.num_replicas
    out: dict[str, Any] = {
        "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
        "initial_replicas": max(a.min_replicas, min(initial, a.max_replicas)),
        "metrics_interval_s": a.metrics_interval_s, "look_back_period_s": a.look_back_period_s}
    if a.policy == "requests":
        factors = {k: v for k in ("upscaling_factor", "downscaling_factor") if (v := getattr(a, k)) is not None}
        return out | factors | {"target_ongoing_requests": a.target_ongoing_requests,
                                "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
                                "downscale_to_zero_delay_s": a.downscale_to_zero_delay_s}
    policy = {"policy_function": "affinity_serve.autoscale.serve_policy:EngineAwarePolicy",
              "policy_kwargs": engine_policy_kwargs(config, section)}
    if pool is not None:
        policy = {"policy_function": "affinity_serve.autoscale.pools:PoolPolicy",
                  "policy_kwargs": {**policy["policy_kwargs"], "pool": pool}}
    return out | {"upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
                  "policy": policy}


def ingress_deployment(config: AppConfig):
    s = config.serve
    replicas = s.num_replicas
    if config.disaggregation.enabled:            # the ingress calls the decode pool
        from affinity_serve.app.disagg_config import pool_initial_replicas
        replicas = max(1, pool_initial_replicas(config.autoscaling, config.disaggregation.decode, "decode"))
    return serve.deployment(IngressServer).options(
        name="Ingress", num_replicas=s.ingress_replicas, **ingress_placement(config),
        max_ongoing_requests=max(1000, s.max_ongoing_requests * replicas * 4),
        graceful_shutdown_timeout_s=s.graceful_shutdown_timeout_s)


def build_app(config: AppConfig | dict | None = None):
    """The Serve application: Ingress (FastAPI) -> handle -> LLMReplica x N."""
    if config is None:
        config = AppConfig()
    elif isinstance(config, dict):
        config = AppConfig.model_validate(config)
    config = resolve_model(config)
    # The sections themselves are the deployments' arguments (pickled by Serve, as Ray Serve LLM binds its
    # LLMConfig): validated once, here. Serve keeps deployment arguments in its controller and Ray's GCS:
    # the API key goes as a digest only, so no bound section carries it.
    key = config.serve.api_key
    config = config.model_copy(update={"serve": config.serve.model_copy(update={"api_key": None})})
    digest = APIKeyDigest.of(key.get_secret_value()) if key is not None else None
    engine = config.engine.to_engine_config()
    if config.disaggregation.enabled:
        replica = disagg_deployments(config, engine)
    else:
        replica = replica_deployment(config).bind(engine, config.serve, config.observability,
                                                  autoscaling=config.autoscaling)
    return ingress_deployment(config).bind(replica, config, digest)


def app_builder(args: dict[str, Any]):
    """`serve run app.builder:app_builder config=path.yaml` (or with no args: the demo defaults). Under
    `serve run` the config's serve.host, serve.port and proxy_location apply (start_serve_for_serve_run)."""
    from affinity_serve.app.http import HTTP_LIMITS_ENV, parse_http_limits
    path = args.get("config") or os.environ.get("AFFINITY_SERVE_CONFIG")
    config = AppConfig.from_yaml(path) if path else AppConfig()
    if os.environ.get(HTTP_LIMITS_ENV):          # a node's own limits: refused here, before the proxy starts
        parse_http_limits(os.environ[HTTP_LIMITS_ENV])
    start_serve_for_serve_run(config)
    return build_app(config)


def start_serve_for_serve_run(config: AppConfig) -> bool:
    """`serve run IMPORT_PATH` calls the builder before it starts Ray and Serve, then starts Serve's proxy on
    its own defaults (port 8000, every node) and ignores the config's. Inside `serve run` (its click
    context) and before Ray starts, do what it would do (ray.init with its --address, --runtime-env and
    --working-dir, in Serve's namespace) and start Serve with the config's HTTP options and the HTTP layer's
    limits; serve run then finds that Serve. Anywhere else (a Serve config deployed by `serve deploy`, whose
    own http_options apply; a Python caller): nothing. Returns whether it started Serve."""
    import click
    import ray
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.info_name != "run" or "config_or_import_path" not in ctx.params or ray.is_initialized():
        return False
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.serve._private.constants import SERVE_NAMESPACE
    p = ctx.params
    runtime_env = parse_runtime_env_args(runtime_env=p.get("runtime_env"), runtime_env_json=p.get("runtime_env_json"),
                                         working_dir=p.get("working_dir"))
    os.environ.update(http_limits_env(config))      # a local Ray started here gives them to the proxy
    ray.init(address=p.get("address"), namespace=SERVE_NAMESPACE, runtime_env=runtime_env)
    serve.start(**serve_start_options(config))
    return True
