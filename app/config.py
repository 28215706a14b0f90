"""AppConfig: the one root configuration (loadable from YAML) with engine, serve, routing,
autoscaling and observability sections. The engine section is the engine's own EngineConfig, so the
two cannot drift. Only builder.py turns it into Serve options."""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PositiveFloat, SecretStr, ValidationError, field_validator,
                      model_validator)

from affinity_serve.app.disagg_config import NIXL_EXPIRY_MARGIN_S, DisaggregationSection, nixl_installed
from affinity_serve.app.routing.config import AffinityConfig, RoutingPolicyName
from affinity_serve.autoscale.policy import PolicyConfig
from affinity_serve.engine.config import EngineConfig, KVConnectorConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AppEngineConfig(EngineConfig):
    """The engine's own EngineConfig, except that `model: null` serves the embedded demo model."""

    model: str | None = Field(None, description="local Hugging Face checkpoint directory; null = the demo model")

    def to_engine_config(self) -> EngineConfig:
        """The EngineConfig a replica builds its engine from (the model must be resolved by then)."""
        if not self.model:
            raise ValueError("engine.model is unset: resolve the demo model first (app.builder.resolve_model)")
        return EngineConfig.model_validate(self.model_dump())


class ServeSection(_Strict):
    app_name: str = Field("affinity", description="the Serve application name (serve.get_app_handle)")
    route_prefix: str = Field("/", description="HTTP path prefix of the app")
    host: str = Field("127.0.0.1", description="bind address; use 0.0.0.0 only deliberately")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    model_name: str | None = Field(None, description="name clients send as `model` (default: dir name)")
    num_replicas: int = Field(1, ge=1, description="model replicas when autoscaling is off (not used with "
                              "disaggregation: each pool has its own num_replicas)")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPU share per CPU replica")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per model replica; 0: one with engine.device "
                                    "cuda, none otherwise")
    replica_resources: dict[str, PositiveFloat] = Field(
        {}, description="custom Ray resources each model replica requests, e.g. {llm_replica_slot: 1}")
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread: at most this many model replicas "
                                              "per node (null: no limit)")
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPU share per ingress replica")
    ingress_replicas: int = Field(1, ge=1, description="ingress replicas (each runs its own router)")
    ingress_resources: dict[str, PositiveFloat] = Field(
        {}, description="custom Ray resources the ingress requests, e.g. {cpu_node: 0.001} to keep it on CPU nodes")
    proxy_location: Literal["HeadOnly", "EveryNode"] = Field(
        "HeadOnly", description="where Serve runs HTTP proxies (EveryNode: one per node, each binding host:port)")
    max_ongoing_requests: int = Field(64, ge=1, description="per replica")
    max_queued_requests: int = Field(256, ge=-1, description="per caller; beyond it requests get 429")
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) of 429 and 503 responses")
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="a stopping replica finishes its "
                                               "requests for up to this long")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGINT or SIGTERM, `serve` refuses new "
                                   "requests (503) and waits this long for those in flight; streams still "
                                   "running then end with an error event")
    health_check_period_s: float = Field(5.0, gt=0, description="how often Serve checks each replica")
    health_check_timeout_s: float = Field(10.0, gt=0, description="a health check slower than this fails")
    wedge_timeout_s: float = Field(30.0, gt=0, description="running requests but no step for this long = unhealthy")
    first_token_timeout_s: float = Field(60.0, gt=0, description="503 when no replica produced anything by then")
    cold_start_timeout_s: float = Field(30.0, gt=0, description="a request arriving while no model replica runs "
                                        "(scaled to zero, or all starting) waits this long for one, then 503")
    api_key: SecretStr | None = Field(None, description="require `Authorization: Bearer <key>` on inference "
                                      "routes (masked when printed; the CLI also reads AFFINITY_SERVE_API_KEY "
                                      "or --api-key-file)")
    max_request_body_bytes: int = Field(4 * 2**20, ge=1024, description="larger request bodies get 413")
    # Limits on hostile or unlucky traffic (docs/limits.md)
    max_prompts_per_request: int = Field(64, ge=1, description="completions: more prompts in one request get 400")
    max_queue_wait_s: float | None = Field(30.0, gt=0, description="admission control: a request whose best "
                                           "predicted time to first token over the replicas (the router's TTFT "
                                           "model: queued prefill, running load, KV pressure, and the wait for "
                                           "KV room while the blocks ahead of it exceed the replica's pool; "
                                           "docs/limits.md) exceeds this "
                                           "gets 429 with Retry-After instead of queueing; null: never "
                                           "(prefix_affinity policy only)")
    max_json_depth: int = Field(32, ge=2, description="request bodies nested deeper than this get 400")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="larger request headers (all together) get 431")
    body_read_timeout_s: float = Field(15.0, gt=0, description="a request body not received within this gets 408")
    max_connections: int = Field(1024, ge=1, description="HTTP requests in flight at the proxy; beyond it 503")
    max_connections_per_client: int = Field(256, ge=1, description="HTTP requests in flight per client address; "
                                            "beyond it 429")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="how tool_choice 'auto' reads a chat's tool calls back (vLLM's --tool-call-parser): "
                            "auto = the format the chat template writes (else such requests get 400); hermes "
                            "(Hermes/Qwen <tool_call>), llama3_json, mistral ([TOOL_CALLS], old and v11 forms) "
                            "for every model; none = tool_choice 'auto' gets 400")
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or the path of a file holding one, used for chat requests "
                          "instead of the tokenizer's (vLLM's --chat-template): a base model without one, or "
                          "another format; a path is read when the config loads")

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """The template's text: a file's content when `value` names one, else `value` itself if it is
        Jinja; either must compile."""
        if value is None:
            return None
        path = Path(value).expanduser()
        text = value
        if "{" not in value:
            if not path.is_file():
                raise ValueError(f"{value!r} is neither a file nor a Jinja template")
            text = path.read_text(encoding="utf-8")
        import jinja2
        try:          # as transformers compiles it (its loop controls and {% generation %} included)
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def _compile_jinja_template(t: str) -> None:
                ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(t)
        try:
            _compile_jinja_template(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
        return text

    @field_validator("replica_resources", "ingress_resources")
    @classmethod
    def _custom_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & _BUILTIN_RESOURCES)
        if builtin:
            raise ValueError(f"{', '.join(builtin)}: not a custom resource (use replica_num_cpus, replica_num_gpus "
                             "or ingress_num_cpus)")
        return resources


_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


#: routing.kv_events_idle_s below this (and above 0) is refused: it would pause within ordinary request gaps
MIN_KV_EVENTS_IDLE_S = 30.0


class RoutingSection(_Strict):
    """Which replica serves a request (app/routing; docs/routing.md)."""

    policy: RoutingPolicyName = Field("prefix_affinity", description="prefix_affinity | power_of_two | round_robin "
                                      "| llm_d_precise (a re-implementation of llm-d's precise scorer, for "
                                      "comparisons)")
    request_routing_stats_period_s: float = Field(1.0, gt=0, description="how often Serve polls each "
                                                  "replica's stats for the routers")
    request_routing_stats_timeout_s: float = Field(5.0, gt=0, description="a stats poll slower than this "
                                                   "is dropped")
    kv_events_period_s: float = Field(0.25, gt=0, description="how often each router pulls every replica's KV "
                                      "events (about 0.5 at 128 replicas)")
    kv_events_timeout_s: float = Field(1.0, gt=0, description="a replica slower than this is skipped for a period")
    kv_events_idle_s: float = Field(300.0, ge=0, description="a router that routed nothing for this long stops "
                                    "pulling KV events and drops its index (one Serve keeps for a dropped "
                                    "handle, an idle ingress); its next request routes on load while it "
                                    "resyncs from snapshots within a pull period. 0: never, else at least "
                                    f"{MIN_KV_EVENTS_IDLE_S:g}")
    warmup_on_join: bool = Field(True, description="prefill a replica that joins (scale-out, replacement) with "
                                 "the router's hottest prefixes before affinity traffic finds it")
    warmup_num_prefixes: int = Field(8, ge=0, description="how many of the hottest prefix groups to prefill")
    affinity: AffinityConfig = AffinityConfig()

    @field_validator("kv_events_idle_s")
    @classmethod
    def _idle_not_between_requests(cls, v: float) -> float:
        if 0 < v < MIN_KV_EVENTS_IDLE_S:
            raise ValueError(f"must be 0 (never pause) or at least {MIN_KV_EVENTS_IDLE_S:g} s: a router pausing "
                             "within the gaps between requests drops its index each time and loses its prefix "
                             f"hits; got {v:g}")
        return v


class _ServeAutoscaling(_Strict):
    """The autoscaling options that are Serve's own (builder.autoscaling_config), not the engine policy's."""

    enabled: bool = Field(False, description="false: serve.num_replicas, fixed")
    policy: Literal["engine", "requests"] = Field(
        "engine", description="engine: autoscale/policy.py on the engines' signals; requests: Serve's default "
        "(replicas = ongoing requests / target_ongoing_requests)")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at start, as Serve's initial_replicas "
                                         "(null: serve.num_replicas, kept within min_replicas..max_replicas)")
    upscaling_factor: float | None = Field(None, gt=0, description="requests policy: Serve's upscaling_factor, "
                                           "scaling each upscaling decision (the engine policy bounds a step "
                                           "with max_upscale_factor)")
    downscaling_factor: float | None = Field(None, gt=0, description="requests policy: Serve's "
                                             "downscaling_factor, scaling each downscaling decision")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often replicas push their metrics")
    look_back_period_s: float = Field(5.0, gt=0, description="Serve averages the metrics over this window")
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests policy: ongoing requests per replica")


class AutoscalingSection(PolicyConfig, _ServeAutoscaling):
    """How many model replicas run (autoscale/; docs/autoscaling.md): Serve's autoscaling options, then the
    engine policy's knobs (`autoscale.policy.PolicyConfig`, where they are defined; min/max replicas and the
    delays apply to both policies). Other names Serve's autoscaling_config uses are refused with the key to
    write instead."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    signal_window_s: float = Field(
        10.0, gt=0, description="each model replica's look-back for the request timings it reports (TTFT and "
        "TPOT p90, requests and prefill tokens per second, recent request count): a request leaves these "
        "signals this long after its first token, so a fleet is idle to the policy (and can go to zero) only "
        "then; with P/D, each pool's own setting")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSection":
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must be within min_replicas "
                             f"({self.min_replicas}) and max_replicas ({self.max_replicas})")
        if self.policy == "engine":
            for name in ("upscaling_factor", "downscaling_factor"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to policy: requests (Serve's own rule); the engine policy "
                                     "bounds a scale-up step with max_upscale_factor")
            # (a value other than the default: the CLI re-validates a dumped config, where every field reads as set)
            if self.target_ongoing_requests != type(self).model_fields["target_ongoing_requests"].default:
                raise ValueError("target_ongoing_requests applies to policy: requests (Serve's own rule); the "
                                 "engine policy sizes the fleet from the engines' load against ttft_slo_s, "
                                 "tpot_slo_s and target_utilization (set policy: requests to count requests)")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s}) must be greater than "
                             f"metrics_interval_s ({self.metrics_interval_s})")
        return self


class ObservabilitySection(_Strict):
    service_name: str = Field("affinity-serve", description="OpenTelemetry service name")
    traces: Literal["none", "memory", "console", "otlp"] = Field(
        "memory", description="where spans go: none, kept in memory, printed, or sent over OTLP")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint for traces and metrics")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level of the app's "
                                                                    "JSON log lines")
    max_spans_kept: int = Field(2000, ge=0, description="with traces: memory, the finished spans each process "
                                "keeps (the ingress's: debug_spans on the handle API)")
    metrics_push_interval_s: float = Field(
        1.0, gt=0, le=60, description="how often every ingress and model replica sends its metrics to the app's "
        "metrics hub, which /metrics reads: the most a replica gauge on /metrics lags")
    vllm_metric_names: bool = Field(
        True, description="/metrics also writes each metric vLLM has under vLLM's name (vllm:..., labels "
        "model_name and finished_reason), so dashboards made for vLLM work unchanged")


class AppConfig(_Strict):
    engine: AppEngineConfig = AppEngineConfig()
    serve: ServeSection = ServeSection()
    routing: RoutingSection = RoutingSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    observability: ObservabilitySection = ObservabilitySection()
    disaggregation: DisaggregationSection = DisaggregationSection()

    @model_validator(mode="after")
    def _check_disaggregation(self) -> "AppConfig":
        """Each pool's autoscaling and engine settings (laid over the app's sections) are checked whether or
        not disaggregation is enabled, one line per problem naming its full path; the P/D connector's needs only
        when it is."""
        d = self.disaggregation
        base = EngineConfig.model_validate({**self.engine.model_dump(), "model": self.engine.model or "unresolved"})
        problems = []
        for name in ("prefill", "decode"):
            problems += _pool_problems(name, d, base, self.engine.model_dump(), self.autoscaling)
        if problems:
            raise ValueError("\n  ".join(problems))
        if not d.enabled:
            return self
        if d.prefill_timeout_s is not None and d.prefill_timeout_s >= self.serve.first_token_timeout_s:
            raise ValueError(f"disaggregation.prefill_timeout_s ({d.prefill_timeout_s:g}s) must be below "
                             f"serve.first_token_timeout_s ({self.serve.first_token_timeout_s:g}s): the ingress "
                             "would give up on the request before its decode replica stops waiting for the "
                             "prefill pool and recomputes it")
        if d.transport == "nixl" and not nixl_installed():
            raise ValueError("disaggregation.transport nixl needs NIXL's Python package, which is not installed: "
                             "pip install 'affinity-serve[nixl]' (or transport ray)")
        if d.transport == "nixl" and d.transfer_timeout_s <= NIXL_EXPIRY_MARGIN_S:
            raise ValueError(f"disaggregation.transfer_timeout_s ({d.transfer_timeout_s:g}s) must be above "
                             f"{NIXL_EXPIRY_MARGIN_S:g}s with transport nixl: a decode replica starts no read that "
                             "close to a hold's expiry, so every request would be recomputed")
        if self.engine.kv_connector.type != "none":
            raise ValueError(f"disaggregation uses the pd KV connector; engine.kv_connector.type "
                             f"{self.engine.kv_connector.type!r} cannot be combined with it yet")
        timeout = self.engine.kv_connector.transfer_timeout_s
        if timeout not in (d.transfer_timeout_s, KVConnectorConfig.model_fields["transfer_timeout_s"].default):
            raise ValueError(f"engine.kv_connector.transfer_timeout_s: {timeout:g} is not used with disaggregation: "
                             "set disaggregation.transfer_timeout_s (how long a prefill replica holds KV nobody "
                             "copied out) instead")
        if self.engine.kv_connector.engine_id is not None:
            raise ValueError(f"engine.kv_connector.engine_id: {self.engine.kv_connector.engine_id!r} would name "
                             "every replica of both pools alike (a transfer names the engine that holds its KV); "
                             "remove it: each engine takes a unique one")
        if not self.engine.cache.enable_prefix_caching:
            raise ValueError("disaggregation needs engine.cache.enable_prefix_caching (transferred blocks are "
                             "admitted as prefix hits)")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        """Load a YAML file; raises ConfigError (one line per problem) instead of a pydantic traceback."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(str(path), [f"cannot read the file: {e.strerror or e}"]) from None
        except yaml.YAMLError as e:
            raise ConfigError(str(path), [_yaml_problem(e)]) from None
        if not isinstance(data, dict):
            raise ConfigError(str(path), ["the top level must be a mapping of sections (engine, serve, ...)"])
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "configuration") -> "AppConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = [line for err in e.errors() for line in _describe(err).split("\n  ")]
            if any(err["loc"] for err in e.errors()):    # a field's error: the pools' checks did not run
                problems += [p for p in _unchecked_pool_problems(data) if p not in problems]
            raise ConfigError(source, problems) from None


def _pool_problems(name: str, d: DisaggregationSection, base: EngineConfig, engine: dict[str, Any],
                   autoscaling: AutoscalingSection, *, cross_field: bool = True) -> list[str]:
    """One P/D pool's autoscaling and engine settings laid over the app's sections (`base`: the engine
    section with a model; `engine`: it as given), one line per problem naming its full path. `cross_field`
    False: only the problems of a key on its own (an unknown key, a value out of range), for a check against
    default sections when the app's own were invalid."""
    from affinity_serve.app.disagg_config import (PoolSection, pool_autoscaling, pool_engine_config,
                                                  pool_engine_problems, without_shared_keys)
    pool: PoolSection = getattr(d, name)
    other: PoolSection = getattr(d, "decode" if name == "prefill" else "prefill")
    problems = pool_engine_problems(name, pool.engine, engine, other.engine, devices=cross_field)
    checked_pool = pool.model_copy(update={"engine": without_shared_keys(pool.engine)})
    for part, check in (("autoscaling", lambda: pool_autoscaling(autoscaling, pool, name)),
                        ("engine", lambda: pool_engine_config(base, checked_pool, d))):
        try:
            check()
        except ValidationError as e:
            problems += [f"disaggregation.{name}." + _describe({**err, "loc": (part, *err["loc"])})
                         for err in e.errors() if cross_field or err["type"] != "value_error"]
        except ValueError as e:              # a check across fields, its message names the path
            if cross_field:
                problems.append(str(e))
    return problems


def _unchecked_pool_problems(data: dict[str, Any]) -> list[str]:
    """The P/D pools' problems when an error elsewhere kept AppConfig's own check of them from running (it
    runs once every section is valid), so one pass reports them all: each pool's settings on their own, laid
    over the app's engine and autoscaling sections where those are valid, else over the defaults (then only
    the problems of a key on its own)."""
    raw = data.get("disaggregation")
    if not isinstance(raw, dict):
        return []
    pools = {}
    for name in ("prefill", "decode"):
        pool = raw.get(name, {})
        if not isinstance(pool, dict):
            return []
        pools[name] = {k: v for k, v in pool.items() if k in ("engine", "autoscaling") and isinstance(v, dict)}
    try:
        d = DisaggregationSection.model_validate(pools)
    except ValidationError:
        return []
    engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
    try:
        base = EngineConfig.model_validate({**engine, "model": engine.get("model") or "unresolved"})
        engine_ok = True
    except (ValidationError, TypeError):
        base, engine_ok = EngineConfig(model="unresolved"), False
    try:
        autoscaling = AutoscalingSection.model_validate(data.get("autoscaling") or {})
        autoscaling_ok = True
    except (ValidationError, TypeError):
        autoscaling, autoscaling_ok = AutoscalingSection(), False
    out = []
    for name in ("prefill", "decode"):
        out += _pool_problems(name, d, base, engine if engine_ok else {}, autoscaling,
                              cross_field=engine_ok and autoscaling_ok)
    return out


def served_model_name(config: "AppConfig") -> str:
    """What clients send as `model`: `serve.model_name`; else a hub id as given, without its `@revision` (as
    vLLM serves it: `Qwen/Qwen3-0.6B`); else the model directory's name."""
    if config.serve.model_name:
        return config.serve.model_name
    model = config.engine.model or "model"
    from affinity_serve.engine import is_hub_id
    if is_hub_id(model):
        return model.split("@", 1)[0]
    return Path(model).name


class ConfigError(ValueError):
    """An invalid configuration; `problems` holds one line per problem, each naming its dotted key. `source`:
    the file or option it came from; None for a check of the whole effective configuration (then a single
    problem is one line)."""

    def __init__(self, source: str | None, problems: list[str]):
        head = f"invalid configuration in {source}:" if source else "invalid configuration:"
        if source is None and len(problems) == 1:
            message = f"{head} {problems[0]}"
        else:
            message = head + "".join(f"\n  {p}" for p in problems)
        super().__init__(message)
        self.source = source
        self.problems = problems


def _yaml_problem(e: Exception) -> str:
    """A YAML syntax error as one line: where (line, column: 1-based) and what."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"not valid YAML{where}: {problem}" + (f" ({context})" if context else "")


def _describe(err: Any) -> str:
    """One pydantic error as `engine.cache.block_size: Input should be ... (got 0)`."""
    loc = tuple(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + _suggest(loc)
    elif not isinstance(err.get("input"), (dict, list)) and err["type"] != "missing":
        msg += f" (got {err['input']!r})"
    if not loc and err["type"] == "value_error" and re.match(r"[a-z_]+\.[\w.]+: ", msg):
        return msg                               # a model check's own "path: problem" line(s)
    return f"{'.'.join(loc) or '(top level)'}: {msg}"


#: Ray Serve autoscaling_config names the autoscaling section does not take, and what to write instead
_SERVE_AUTOSCALING_NAMES = {
    "target_num_ongoing_requests_per_replica": "target_ongoing_requests (Serve's newer name)",
    "target_ongoing_requests_per_replica": "target_ongoing_requests",
    "smoothing_factor": "upscaling_factor and downscaling_factor (policy: requests; Serve deprecated "
                        "smoothing_factor)",
    "upscale_smoothing_factor": "upscaling_factor (policy: requests)",
    "downscale_smoothing_factor": "downscaling_factor (policy: requests)",
    "aggregation_function": "nothing: the requests policy uses Serve's default (mean); the engine policy reads the "
                            "engines' own signals",
    "max_ongoing_requests": "serve.max_ongoing_requests (a deployment option, not an autoscaling one)",
    "num_replicas": "serve.num_replicas, or initial_replicas here",
}


#: Ray Serve's nesting of deployment options, and where this config keeps them
_SERVE_NESTING = {
    "autoscaling_config": "the top-level `autoscaling` section (Ray Serve's autoscaling_config, with its "
                          "names; the engine policy is its default)",
    "deployment_config": "the top-level sections: autoscaling for autoscaling_config, serve for num_replicas "
                         "and max_ongoing_requests, serve.replica_num_cpus / replica_num_gpus / replica_resources for "
                         "ray_actor_options",
    "ray_actor_options": "serve.replica_num_cpus, serve.replica_num_gpus and serve.replica_resources (and "
                         "disaggregation.<pool>.replica_resources)",
}


def _suggest(loc: tuple[str, ...]) -> str:
    if len(loc) == 2 and loc[0] == "autoscaling" and loc[1] in _SERVE_AUTOSCALING_NAMES:
        return f" (a Ray Serve autoscaling_config name; here use {_SERVE_AUTOSCALING_NAMES[loc[1]]})"
    if loc and loc[-1] in _SERVE_NESTING:
        return f" (a Ray Serve deployment option; here use {_SERVE_NESTING[loc[-1]]})"
    model: type[BaseModel] = AppConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        model = field.annotation
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(model.model_fields)})"
