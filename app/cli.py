"""`affinity-serve` command line: serve (local Ray + Serve + HTTP), demo-model, config."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="affinity-serve", description="Elastic LLM serving on Ray Serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a local Ray, deploy the app, serve HTTP until Ctrl-C")
    s.add_argument("--config", help="AppConfig YAML file")
    s.add_argument("--model", help="local Hugging Face checkpoint directory (default: the demo model)")
    s.add_argument("--replicas", type=int, help="number of model replicas")
    s.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes the server)")
    s.add_argument("--port", type=int, help="HTTP port (default 8000)")
    s.add_argument("--api-key", help="require this Bearer key on inference routes")
    d = sub.add_parser("demo-model", help="write the small random demo checkpoint to PATH")
    d.add_argument("path")
    d.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    d.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("config", help="print the effective configuration as YAML")
    c.add_argument("--config")
    args = ap.parse_args(argv)
    if args.cmd == "demo-model":
        from engine.demo import write_demo_model
        path = write_demo_model(args.path, arch=args.arch, seed=args.seed)
        print(f"wrote demo {args.arch} checkpoint to {path}")
        return 0
    if args.cmd == "config":
        import yaml
        from app.config import AppConfig
        cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    return serve_cmd(args)


def _load_config(args):
    from app.config import AppConfig
    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    data = cfg.model_dump()
    if args.model:
        data["engine"]["model"] = args.model
    if args.replicas:
        data["serve"]["num_replicas"] = args.replicas
    if args.host:
        data["serve"]["host"] = args.host
    if args.port:
        data["serve"]["port"] = args.port
    if args.api_key:
        data["serve"]["api_key"] = args.api_key
    cfg = AppConfig.model_validate(data)
    if cfg.engine.num_threads is None and cfg.engine.device != "cuda":
        # share the cores between replicas instead of oversubscribing them
        per = max(1, (os.cpu_count() or 1) // max(1, cfg.serve.num_replicas))
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_threads": per})})
    return cfg


def serve_cmd(args) -> int:
    cfg = _load_config(args)
    from app.builder import build_app, resolve_model

    if not cfg.engine.model:
        print("[affinity-serve] no --model given: using the embedded demo model (generated once, cached)")
    cfg = resolve_model(cfg)
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    host, port = cfg.serve.host, cfg.serve.port
    print(f"[affinity-serve] starting Ray on 127.0.0.1 and deploying {cfg.serve.num_replicas} replica(s) of "
          f"{cfg.engine.model} ...", flush=True)
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=True,
             logging_level="WARNING", num_cpus=max(2, os.cpu_count() or 2) * 2)
    serve.start(http_options={"host": host, "port": port})
    done = threading.Event()
    ticker = threading.Thread(target=_progress, args=(done,), daemon=True)
    ticker.start()
    try:
        serve.run(build_app(cfg), name=cfg.serve.app_name, route_prefix=cfg.serve.route_prefix, blocking=False)
    finally:
        done.set()
    url = f"http://{host}:{port}"
    name = cfg.serve.model_name or Path(cfg.engine.model).name
    auth = f" -H 'Authorization: Bearer {cfg.serve.api_key}'" if cfg.serve.api_key else ""
    print(f"\n[affinity-serve] ready: {url}  (OpenAI API at {url}/v1, metrics at {url}/metrics)")
    print("[affinity-serve] try:\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{json.dumps({'model': name, 'prompt': 'Once upon a time', 'max_tokens': 16})}'\n"
          "[affinity-serve] Ctrl-C to stop.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(1.0):      # a timed wait keeps the main thread responsive to signals
        continue
    print("\n[affinity-serve] shutting down (draining in-flight requests) ...", flush=True)
    serve.shutdown()
    ray.shutdown()
    print("[affinity-serve] stopped.")
    return 0


def _progress(done: threading.Event) -> None:
    start = time.monotonic()
    while not done.wait(5.0):
        print(f"[affinity-serve] still deploying ({time.monotonic() - start:.0f}s): loading the model in each "
              "replica ...", flush=True)


if __name__ == "__main__":
    sys.exit(main())
