"""`affinity-serve` command line: serve (local Ray + Serve + HTTP), deploy (onto a running cluster),
demo-model, config."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from affinity_serve.app.config import AppConfig

#: the environment variable `serve` reads the API key from (a key never goes on the command line or stdout)
API_KEY_ENV = "AFFINITY_SERVE_API_KEY"


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad configuration or checkpoint prints one message and returns 2."""
    args = _parser().parse_args(argv)
    from affinity_serve.app.config import ConfigError
    from affinity_serve.engine.errors import ModelLoadError
    try:
        if args.cmd == "demo-model":
            return demo_model_cmd(args)
        if args.cmd == "config":
            return config_cmd(args)
        if args.cmd == "deploy":
            return deploy_cmd(args)
        return serve_cmd(args)
    except ConfigError as e:
        print(f"affinity-serve: error: {e}", file=sys.stderr)
        return 2
    except ModelLoadError as e:
        print(f"affinity-serve: error: engine.model: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:           # Ctrl-C before Ray started (loading the config, the checkpoint checks)
        print("\n[affinity-serve] interrupted; nothing was started.", file=sys.stderr, flush=True)
        return 130


#: serve.tool_call_parser's values (app/tool_calls.py TOOL_PARSER_SETTINGS; a test keeps them equal)
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3_json", "mistral")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="affinity-serve", description="Elastic LLM serving on Ray Serve")
    ap.add_argument("--version", action="version", version=f"affinity-serve {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a local Ray, deploy the app, serve HTTP until Ctrl-C",
                       description="Options spelled as vLLM's `vllm serve` override the --config file's values.")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it "
                   "(same as --model)")
    s.add_argument("--config", help="AppConfig YAML file")
    s.add_argument("--model", help="a local Hugging Face checkpoint directory, or a hub id org/name[@revision] "
                                     "(HF_HOME, HF_TOKEN, HF_HUB_OFFLINE honoured; default: the demo model)")
    s.add_argument("--served-model-name", help="the name clients send as `model` (serve.model_name; default: "
                   "the checkpoint directory's name; a hub id itself)")
    s.add_argument("--max-model-len", type=int, help="context length (engine.max_model_len; default: the model's)")
    s.add_argument("--dtype", help="engine.dtype: auto, float32, bfloat16 or float16")
    s.add_argument("--seed", type=int, help="engine.seed")
    s.add_argument("--block-size", type=int, help="tokens per KV block (engine.cache.block_size)")
    s.add_argument("--max-num-seqs", type=int, help="engine.scheduler.max_num_seqs")
    s.add_argument("--max-num-batched-tokens", type=int, help="engine.scheduler.max_num_batched_tokens")
    s.add_argument("--replicas", type=int, help="number of model replicas (with autoscaling: the initial number, "
                   "within its bounds; refused with disaggregation: set each pool's num_replicas)")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="how tool_choice 'auto' reads tool calls "
                   "back (serve.tool_call_parser; default auto: the chat template's format)")
    s.add_argument("--chat-template", help="a Jinja chat template, or a file holding one, used instead of the "
                   "tokenizer's (serve.chat_template)")
    s.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes the server)")
    s.add_argument("--port", type=int, help="HTTP port (default 8000)")
    s.add_argument("--api-key-file", help=f"require the Bearer key in this file on inference routes (or set "
                   f"{API_KEY_ENV}; both keep the key out of the process list)")
    s.add_argument("--api-key", help=f"require this Bearer key (visible to other users in `ps`: prefer {API_KEY_ENV} "
                   "or --api-key-file)")
    s.add_argument("--address", help="run on this Ray cluster (also RAY_ADDRESS); default: start a local Ray of its "
                   "own, bound to 127.0.0.1")
    s.add_argument("--no-dashboard", action="store_true", help="the local Ray without its dashboard (then Ray's "
                   "`serve status`, `serve deploy` and `ray job` cannot attach); default: on 127.0.0.1:8265")
    s.add_argument("--dashboard-port", type=int, default=8265, help="the local Ray dashboard's port (default 8265)")
    p = sub.add_parser("deploy", help="deploy onto a running Ray cluster (cluster.yaml's head runs it) and exit")
    p.add_argument("--config", required=True, help="AppConfig YAML file (engine.model: a path on the GPU nodes)")
    p.add_argument("--address", default="auto", help="Ray address (default: the cluster this node belongs to)")
    d = sub.add_parser("demo-model", help="write the small random demo checkpoint to PATH")
    d.add_argument("path")
    d.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    d.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("config", help="check a configuration and print the effective one as YAML")
    c.add_argument("--config")
    return ap


def demo_model_cmd(args) -> int:
    from affinity_serve.engine import write_demo_model
    path = write_demo_model(args.path, arch=args.arch, seed=args.seed)
    print(f"wrote demo {args.arch} checkpoint to {path}")
    return 0


def config_cmd(args) -> int:
    """Checks the configuration and, where the model is a checkpoint directory on this machine, the checkpoint
    as `serve` does (weights, tokenizer, context length, engine support); the device, dtype and KV tier are
    left to where the replicas run (this may not be that machine). A hub id or a path that exists only on the
    replicas' nodes is said to be unchecked."""
    import yaml
    from affinity_serve.app.config import AppConfig
    from affinity_serve.app.config import ConfigError
    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    check_extras(cfg)
    problems = replica_bound_problems(cfg, "num_replicas" in cfg.serve.model_fields_set)
    if problems:
        raise ConfigError(args.config, problems)
    note = check_local_checkpoint(cfg)
    for line in replica_warnings(cfg, "num_replicas" in cfg.serve.model_fields_set):
        print(f"[affinity-serve] warning: {line}", file=sys.stderr)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    print(f"[affinity-serve] {note}", file=sys.stderr)
    return 0


def check_local_checkpoint(cfg: "AppConfig") -> str:
    """`config` and `deploy`: where engine.model is a checkpoint directory on this machine, serve's checkpoint
    checks (raising as they do); the device, dtype and KV tier are left to the replicas' machines. Returns
    what was checked, or why nothing was."""
    model = cfg.engine.model
    if model and os.path.isfile(os.path.join(model, "config.json")):
        check_model(cfg, replicas_here=False)
        return (f"checked the checkpoint at {model} (weights, tokenizer, context length, engine support); the "
                "device, dtype and KV tier are checked where the replicas start")
    if model:
        return (f"engine.model {model!r} is not a checkpoint directory on this machine (a hub id, or a path on "
                "the replicas' nodes): its checks run where the replicas start")
    return "no engine.model: `serve` uses the embedded demo model"


def deploy_cmd(args) -> int:
    """Connects to the running cluster, starts Serve's HTTP proxy on serve.host:serve.port (proxy_location),
    deploys, and returns once the app runs; Serve keeps it running inside the cluster. A checkpoint directory
    that is on this machine too (a shared filesystem, the same image) is checked here first, as `config`
    does; one only on the replicas' nodes is checked by the replicas."""
    from affinity_serve.app.config import AppConfig
    cfg = AppConfig.from_yaml(args.config)
    check_extras(cfg)
    problems = replica_bound_problems(cfg, "num_replicas" in cfg.serve.model_fields_set)
    if problems:
        from affinity_serve.app.config import ConfigError
        raise ConfigError(args.config, problems)
    print(f"[affinity-serve] {check_local_checkpoint(cfg)}", file=sys.stderr, flush=True)
    for line in replica_warnings(cfg, "num_replicas" in cfg.serve.model_fields_set):
        print(f"[affinity-serve] warning: {line}", file=sys.stderr, flush=True)
    import ray
    from ray import serve

    ray.init(address=args.address, logging_level="WARNING")
    start_serve(cfg)
    from affinity_serve.app.builder import build_app
    serve.run(build_app(cfg), name=cfg.serve.app_name, route_prefix=cfg.serve.route_prefix, blocking=False)
    print(f"[affinity-serve] deployed {cfg.serve.app_name} at http://{cfg.serve.host}:{cfg.serve.port}", flush=True)
    return 0


def _overrides(args) -> dict[str, object]:
    """The configuration keys the command line sets (None: not given)."""
    return {"engine.model": args.model or args.model_tag, "engine.max_model_len": args.max_model_len,
            "engine.dtype": args.dtype, "engine.seed": args.seed, "engine.cache.block_size": args.block_size,
            "engine.scheduler.max_num_seqs": args.max_num_seqs,
            "engine.scheduler.max_num_batched_tokens": args.max_num_batched_tokens,
            "serve.model_name": args.served_model_name, "serve.num_replicas": args.replicas,
            "serve.host": args.host, "serve.port": args.port, "serve.api_key": _api_key(args),
            "serve.tool_call_parser": args.tool_call_parser, "serve.chat_template": args.chat_template}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("affinity-serve")
    except PackageNotFoundError:        # run from a checkout that was never installed
        return "(not installed)"


def _load_config(args) -> "AppConfig":
    from affinity_serve.app.config import AppConfig, ConfigError
    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    data = cfg.model_dump()
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ConfigError("the command line", [f"MODEL {args.model_tag!r} and --model {args.model!r} differ: "
                                               "give one"])
    for path, value in _overrides(args).items():
        if value is None:
            continue
        *parents, key = path.split(".")
        section = data
        for part in parents:
            section = section[part]
        section[key] = value
    source = f"{args.config or 'the defaults'} with the command-line options"
    file_sets_replicas = "num_replicas" in cfg.serve.model_fields_set
    cfg = AppConfig.from_dict(data, source=source)
    if cfg.disaggregation.enabled and args.replicas is not None:
        raise ConfigError("the command line", [
            f"--replicas {args.replicas}: with disaggregation each pool has its own size; set "
            "disaggregation.prefill.num_replicas and disaggregation.decode.num_replicas (or each pool's "
            "autoscaling) in the --config file instead"])
    problems = replica_bound_problems(cfg, file_sets_replicas or args.replicas is not None)
    if problems:
        raise ConfigError(source, problems)
    for line in replica_warnings(cfg, file_sets_replicas):
        print(f"[affinity-serve] warning: {line}", file=sys.stderr, flush=True)
    if cfg.engine.num_threads is None and cfg.engine.device != "cuda":
        # share the cores between replicas instead of oversubscribing them (with P/D: both pools' replicas)
        per = max(1, (os.cpu_count() or 1) // max(1, sum(model_replicas(cfg).values())))
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_threads": per})})
    return cfg


def model_replicas(cfg: "AppConfig") -> dict[str, int]:
    """The model replicas the app starts with: {"": serve.num_replicas}, or with disaggregation each pool's
    initial count ({"prefill": n, "decode": m}: num_replicas, or its autoscaling's initial replicas)."""
    if not cfg.disaggregation.enabled:
        a = cfg.autoscaling
        if a.enabled:                      # as the builder starts it (autoscaling_config's initial_replicas)
            initial = a.initial_replicas if a.initial_replicas is not None else cfg.serve.num_replicas
            return {"": max(a.min_replicas, min(initial, a.max_replicas))}
        return {"": cfg.serve.num_replicas}
    from affinity_serve.app.disagg_config import pool_initial_replicas
    d = cfg.disaggregation
    return {name: pool_initial_replicas(cfg.autoscaling, getattr(d, name), name) for name in ("prefill", "decode")}


def describe_replicas(cfg: "AppConfig") -> str:
    """`1 replica(s)`, or with disaggregation `1 prefill + 1 decode replica(s)`, for the start-up message."""
    counts = model_replicas(cfg)
    return " + ".join(f"{n} {name}".rstrip() for name, n in counts.items()) + " replica(s)"


def replica_bound_problems(cfg: "AppConfig", num_replicas_set: bool) -> list[str]:
    """With autoscaling (no P/D, no initial_replicas), a serve.num_replicas the user set (`num_replicas_set`:
    --replicas or the file) is the initial size: outside [min_replicas, max_replicas] it was clamped without a
    word; now it is an error, as a pool's num_replicas outside its bounds is."""
    a, n = cfg.autoscaling, cfg.serve.num_replicas
    default = type(cfg.serve).model_fields["num_replicas"].default     # a dumped config sets it too
    if (a.enabled and not cfg.disaggregation.enabled and a.initial_replicas is None and num_replicas_set
            and n != default and not a.min_replicas <= n <= a.max_replicas):
        return [f"serve.num_replicas: {n} is outside the autoscaling bounds [{a.min_replicas}, {a.max_replicas}] "
                "(with autoscaling it is the initial size; change it or the bounds, or set "
                "autoscaling.initial_replicas)"]
    return []


def replica_warnings(cfg: "AppConfig", num_replicas_set: bool) -> list[str]:
    """With disaggregation, a serve.num_replicas the configuration file sets (`num_replicas_set`) is not used:
    a warning (the same file may serve either mode)."""
    if cfg.disaggregation.enabled and num_replicas_set:
        return [f"serve.num_replicas ({cfg.serve.num_replicas}) is ignored with disaggregation: each pool has its "
                "own size (disaggregation.prefill.num_replicas, disaggregation.decode.num_replicas)"]
    return []


def _api_key(args) -> str | None:
    """The API key from --api-key-file, the environment, or --api-key (that one with a warning); None: the
    config file's (if any). Never printed."""
    from affinity_serve.app.config import ConfigError
    if getattr(args, "api_key_file", None):
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ConfigError("--api-key-file", [f"cannot read the file: {e.strerror or e}"]) from None
        if not key:
            raise ConfigError("--api-key-file", ["the file is empty"])
        return key
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV].strip()
    if getattr(args, "api_key", None):
        print(f"[affinity-serve] warning: --api-key shows the key to every user of this machine (`ps`); "
              f"use {API_KEY_ENV} or --api-key-file", file=sys.stderr)
        return args.api_key
    return None


#: optional features and the module each needs: (config key, when it is on, module, the extra that installs it)
_EXTRAS = (("observability.traces", lambda c: c.observability.traces == "otlp",
            "opentelemetry.exporter.otlp.proto.http", "otlp"),
           ("observability.otlp_endpoint", lambda c: bool(c.observability.otlp_endpoint),
            "opentelemetry.exporter.otlp.proto.http", "otlp"))


def check_extras(cfg: "AppConfig") -> None:
    """Before Ray starts: a configured feature whose optional dependency is not installed is one line (a
    replica or ingress would otherwise fail to start, over and over, with a traceback each time)."""
    import importlib.util
    from affinity_serve.app.config import ConfigError
    for key, wanted, module, extra in _EXTRAS:
        if not wanted(cfg):
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:          # a parent package is missing
            found = False
        if not found:
            value = cfg.observability.traces if key.endswith("traces") else cfg.observability.otlp_endpoint
            raise ConfigError(None, [f"{key}: {value!r} needs the {extra!r} extra, which is not installed: "
                                     f"pip install 'affinity-serve[{extra}]'"])


def check_model(cfg: "AppConfig", *, replicas_here: bool = True) -> None:
    """Before Ray starts: the engine's own checkpoint checks, so the message is the one a replica would log
    (the weights from the safetensors headers, the tokenizer actually loaded), and the device and dtype.
    `replicas_here`: the replicas run on this machine (the CLI starts Ray here), so its hardware is theirs;
    joining a cluster (--address), the device, dtype and KV tier checks are left to the replicas."""
    from affinity_serve.engine import check_engine_support, resolve_context_length, validate_checkpoint
    from affinity_serve.app.config import ConfigError
    args = validate_checkpoint(cfg.engine.model, need_tokenizer=not cfg.engine.skip_tokenizer_init)
    if not cfg.engine.skip_tokenizer_init:          # a tokenizer.json that is there but broken fails here
        from affinity_serve.engine import load_tokenizer
        load_tokenizer(cfg.engine.model)
    try:
        resolve_context_length(args, cfg.engine.max_model_len)
    except ValueError as e:
        raise ConfigError(None, [f"engine.max_model_len: {e}"]) from None
    try:
        check_engine_support(args, cfg.engine.kv_connector.type)
        if cfg.disaggregation.enabled:             # both pools run the pd connector (disagg_config)
            try:
                check_engine_support(args, "pd")
            except ValueError:
                raise ValueError("disaggregation.enabled: P/D moves one block table per request and this model "
                                 "has sliding-window layers (a table per KV-cache group); serve it without "
                                 "disaggregation") from None
    except ValueError as e:
        raise ConfigError(None, [str(e)]) from None
    import torch
    if not replicas_here:
        return
    if cfg.engine.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(None, ["engine.device: 'cuda' but this machine has no usable CUDA GPU; use device: "
                                 "auto or cpu"])
    on_cpu = cfg.engine.device == "cpu" or (cfg.engine.device == "auto" and not torch.cuda.is_available())
    if cfg.engine.dtype == "float16" and on_cpu:    # the engine's pick_dtype refuses it in every replica
        where = "engine.device is 'cpu'" if cfg.engine.device == "cpu" else "this machine has no usable CUDA GPU"
        raise ConfigError(None, [f"engine.dtype: 'float16' is not supported on CPU ({where}); use float32 or "
                                 "bfloat16"])
    # a KV tier that would fail every replica (an unsafe store root or namespace directory, an offload tier
    # larger than this machine's memory) fails here, once, naming its key
    from affinity_serve.engine import check_kv_connector
    problems = check_kv_connector(cfg.engine, args)
    if problems:
        raise ConfigError(None, problems)


#: shorter API keys draw a warning: the ingress holds a salted digest, and a short key can be guessed from it
MIN_API_KEY_CHARS = 16


def exposure_warnings(cfg: "AppConfig") -> list[str]:
    """What an operator should hear before the server starts: an address beyond loopback with no API key, a
    short key. Warnings, not errors (a trusted network may be the operator's choice)."""
    out = []
    key = cfg.serve.api_key.get_secret_value() if cfg.serve.api_key else None
    if cfg.serve.host not in ("127.0.0.1", "localhost", "::1") and not key:
        out.append(f"serving on {cfg.serve.host} without an API key: anyone who reaches port {cfg.serve.port} can "
                   f"use the model (set {API_KEY_ENV} or --api-key-file)")
    if key and len(key) < MIN_API_KEY_CHARS:
        out.append(f"the API key has {len(key)} characters; use a long random one (e.g. openssl rand -hex 32)")
    return out


def serve_cmd(args) -> int:
    cfg = _load_config(args)
    from affinity_serve.app.builder import build_app, resolve_model

    if not cfg.engine.model:
        print("[affinity-serve] no --model given: using the embedded demo model (generated once, cached)")
    check_extras(cfg)
    cfg = resolve_model(cfg)
    address = args.address or os.environ.get("RAY_ADDRESS")
    check_model(cfg, replicas_here=address in (None, "", "local"))      # "local": a new Ray on this machine
    for line in exposure_warnings(cfg):
        print(f"[affinity-serve] warning: {line}", file=sys.stderr, flush=True)
    # During start-up Ctrl-C and SIGTERM raise KeyboardInterrupt and are also recorded: Ray can swallow the
    # exception when it lands inside its own calls (seen: Ctrl-C while Serve started, and the app deployed and
    # waited for a signal that had already come), so each start-up step checks the record too.
    _INTERRUPTED.clear()
    previous = (signal.signal(signal.SIGINT, _interrupt), signal.signal(signal.SIGTERM, _interrupt))
    try:
        address = args.address or os.environ.get("RAY_ADDRESS")
        init_ray(address, cfg, dashboard_port=None if args.no_dashboard else args.dashboard_port)
        _raise_if_interrupted()
        from ray import serve
        print(f"[affinity-serve] deploying {describe_replicas(cfg)} of {cfg.engine.model} ...",
              flush=True)
        start_serve(cfg)
        _raise_if_interrupted()
        done = threading.Event()
        ticker = threading.Thread(target=_progress, args=(done,), daemon=True)
        ticker.start()
        try:
            serve.run(build_app(cfg), name=cfg.serve.app_name, route_prefix=cfg.serve.route_prefix,
                      blocking=False)
        finally:
            done.set()
        _raise_if_interrupted()
    except KeyboardInterrupt:
        _ignore_signals()                 # a second Ctrl-C or SIGTERM must not cut the clean-up short
        _stop_ray()
        print("\n[affinity-serve] interrupted during start-up; stopped.", flush=True)
        return 130
    finally:
        if not _INTERRUPTED.is_set():
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])
    print(ready_message(cfg, "" if address else attach_message(cfg), getattr(args, "api_key_file", None)),
          flush=True)
    signals: list[int] = []
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        signals.append(signum)
        stop.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(1.0):      # a timed wait keeps the main thread responsive to signals
        continue
    finished, ended = drain(cfg, hurry=lambda: len(signals) > 1)
    _ignore_signals()
    _stop_ray()
    print(f"[affinity-serve] stopped ({finished} request(s) finished while draining, {ended} stream(s) ended "
          "early).", flush=True)
    return 0


#: set by a Ctrl-C or SIGTERM during `serve`'s start-up (see serve_cmd)
_INTERRUPTED = threading.Event()


def _interrupt(signum, _frame) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt


def _raise_if_interrupted() -> None:
    """A start-up signal whose KeyboardInterrupt Ray swallowed still stops the start-up."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def _ignore_signals() -> None:
    """While Ray stops: another Ctrl-C or SIGTERM (a supervisor repeating it) must not kill this process before
    its one closing line (seen: a repeated SIGTERM during ray.shutdown() ended it with status -15)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_ray() -> None:
    """Stop what `serve` started: Serve first, then Ray (the local Ray of its own, or this driver's connection
    to a cluster). Measured: ray.shutdown() alone, with Serve still up, ended this process with SIGTERM
    (status -15) even with the signal ignored, so Serve is always shut down first (it prints two notices of
    Ray's about the controller tasks it kills)."""
    import ray
    if ray.is_initialized():
        from ray import serve
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def drain(cfg: "AppConfig", hurry: Callable[[], bool] = lambda: False, poll_s: float = 0.25) -> tuple[int, int]:
    """The shutdown drain: every ingress replica refuses new HTTP requests (503 `draining`) while those in
    flight finish, for up to serve.drain_timeout_s (or until `hurry()`: a second Ctrl-C); streams still
    running then end with an in-band error event and [DONE]. Returns (finished while draining, ended)."""
    from ray import serve
    try:
        handle = serve.get_deployment_handle("Ingress", app_name=cfg.serve.app_name)
    except KeyError:                # the app was deleted meanwhile (serve.delete, `serve shutdown`): nothing to drain
        print(f"\n[affinity-serve] app {cfg.serve.app_name!r} is no longer deployed: nothing to drain; stopping",
              flush=True)
        return 0, 0
    except Exception as e:          # Serve or its controller unreachable: stop anyway
        print(f"\n[affinity-serve] drain skipped ({type(e).__name__}); stopping", flush=True)
        return 0, 0

    def broadcast(end_streams: bool) -> dict[str, int]:
        """Each ingress replica's requests in flight (a handle call reaches one replica: call until each
        answered, or a few seconds passed)."""
        seen: dict[str, int] = {}
        deadline = time.monotonic() + 5
        while len(seen) < cfg.serve.ingress_replicas and time.monotonic() < deadline:
            st = handle.drain.remote(end_streams).result(timeout_s=5)
            seen[st["ingress_replica_id"]] = st["num_in_flight"]
        return seen

    try:
        first = sum(broadcast(False).values())
        print(f"\n[affinity-serve] draining: new requests get 503; {first} in flight, waiting up to "
              f"{cfg.serve.drain_timeout_s:g}s for them (Ctrl-C again: stop now) ...", flush=True)
        deadline = time.monotonic() + cfg.serve.drain_timeout_s
        left = first
        while left and time.monotonic() < deadline and not hurry():
            time.sleep(poll_s)
            left = sum(broadcast(False).values())
        if left:
            broadcast(True)
            end = time.monotonic() + 5
            while sum(broadcast(True).values()) and time.monotonic() < end:
                time.sleep(poll_s)
        return first - left, left
    except Exception as e:          # an ingress that is gone or stuck: stop anyway
        print(f"[affinity-serve] drain incomplete ({type(e).__name__}); stopping", flush=True)
        return 0, 0


def ready_message(cfg: "AppConfig", attach: str = "", key_file: str | None = None) -> str:
    """Where the server is and a request to paste (then `attach`: how other programs reach its Ray). The API
    key itself is never printed: the curl line reads it from where the server read it (`key_file`, given with
    --api-key-file, else the environment variable)."""
    url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    from affinity_serve.app.config import served_model_name
    name = served_model_name(cfg)
    source = f"$(cat {shlex.quote(key_file)})" if key_file else f"${API_KEY_ENV}"
    auth = f" -H \"Authorization: Bearer {source}\"" if cfg.serve.api_key else ""
    return (f"\n[affinity-serve] ready: {url}  (OpenAI API at {url}/v1, metrics at {url}/metrics)\n"
            "[affinity-serve] try:\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{json.dumps({'model': name, 'prompt': 'Once upon a time', 'max_tokens': 16})}'\n"
            + attach + "[affinity-serve] Ctrl-C to stop.")


def attach_message(cfg: "AppConfig") -> str:
    """How another Python process (a Ray driver) and Ray's own CLI reach the app on the local Ray this process
    started. That Ray listens on 127.0.0.1 only and requires Ray's token (~/.ray/auth_token): a driver must
    not resolve 127.0.0.1 to the machine's outward address (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) and must
    send the token (RAY_AUTH_MODE=token: Ray turns it on by itself only for a cluster it finds, never for an
    address it is given); Ray's CLI likewise."""
    import ray
    gcs = ray.get_runtime_context().gcs_address
    lines = [f"[affinity-serve] other Ray drivers: RAY_ADDRESS={gcs} RAY_AUTH_MODE=token "
             f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python ... (then ray.init(); "
             f"serve.get_app_handle(\"{cfg.serve.app_name}\"))\n"]
    dashboard = _dashboard_url()
    if dashboard:
        lines.append(f"[affinity-serve] Ray's tools: RAY_AUTH_MODE=token serve status --address {dashboard}\n")
    return "".join(lines)


def _dashboard_url() -> str | None:
    import ray
    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:
        return None
    return f"http://{url}" if url else None


def init_ray(address: str | None, cfg: "AppConfig", dashboard_port: int | None = 8265) -> None:
    """A Ray cluster the user asked for (--address / RAY_ADDRESS), or a local Ray of this process's own:
    address="local" (never a cluster some earlier `ray start` left recorded on the machine), every Ray
    process bound to 127.0.0.1 (the node address and Ray's local-only mode; Ray's token authentication
    stays on), its Serve proxy enforcing the HTTP layer's limits. Says which on stdout."""
    if address:
        print(f"[affinity-serve] connecting to the Ray cluster at {address} (--address / RAY_ADDRESS); the HTTP "
              "limits apply where its nodes were started with them (docs/limits.md)", flush=True)
        import ray
        ray.init(address=address, configure_logging=True, logging_level="WARNING")
        return
    from affinity_serve.app.builder import http_limits_env
    os.environ.update(http_limits_env(cfg))         # the proxy, a worker of the Ray started below, reads it
    # Before Ray is imported: Ray reads it once. Off, Ray binds its GCS, raylet, workers and agents to the
    # loopback address instead of every interface (an open Ray port runs any code that reaches it).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants
    ray_constants.ENABLE_RAY_CLUSTER = False        # Ray imported before this call (tests, embedding)
    print("[affinity-serve] starting a local Ray of its own on 127.0.0.1 (to use a cluster: --address or "
          "RAY_ADDRESS)", flush=True)
    dashboard = ({"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port}
                 if dashboard_port is not None else {"include_dashboard": False})
    ray.init(address="local", _node_ip_address="127.0.0.1", configure_logging=True, logging_level="WARNING",
             num_cpus=max(2, os.cpu_count() or 2) * 2,
             runtime_env={"worker_process_setup_hook": "affinity_serve.app.cli.loopback_worker_setup"}, **dashboard)


def loopback_worker_setup() -> None:
    """Ray's worker_process_setup_hook for the local Ray `serve` starts: Ray Serve 2.60 binds each replica's
    inter-deployment gRPC server to every interface ("[::]:0", no option); on a loopback-only Ray it binds
    to 127.0.0.1 instead (the only address its callers use there)."""
    from ray.serve._private import replica
    bind = replica.add_port_to_grpc_server
    if getattr(bind, "loopback", False):
        return

    def loopback(server, address):
        return bind(server, "127.0.0.1:0" if address == "[::]:0" else address)
    loopback.loopback = True
    replica.add_port_to_grpc_server = loopback


def start_serve(cfg: "AppConfig") -> None:
    """serve.start with the configured HTTP bind and proxy placement. serve.run, next, connects to the Serve
    it started and would log "Connecting to existing Serve app ... will not be applied" about it: dropped."""
    import logging

    from ray import serve

    from affinity_serve.app.builder import serve_start_options
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _NoReconnectNotice) for f in serve_logger.filters):
        serve_logger.addFilter(_NoReconnectNotice())
    serve.start(**serve_start_options(cfg))


class _NoReconnectNotice:
    """A logging filter: Serve's notice that serve.run found the Serve that start_serve just started."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Connecting to existing Serve app")


def _progress(done: threading.Event) -> None:
    start = time.monotonic()
    while not done.wait(5.0):
        print(f"[affinity-serve] still deploying ({time.monotonic() - start:.0f}s): loading the model in each "
              "replica ...", flush=True)


if __name__ == "__main__":
    sys.exit(main())
