"""Deploy the app onto an already-running Ray cluster: `python -m app.cluster_deploy CONFIG.yaml`.

cluster.yaml's head start command runs this; it connects to the local head, starts Serve's HTTP proxy
on the configured host/port, deploys, and exits (Serve keeps running inside the cluster).
"""
from __future__ import annotations

import sys

import ray
from ray import serve

from app.builder import build_app
from app.config import AppConfig, ConfigError


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m app.cluster_deploy CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        cfg = AppConfig.from_yaml(argv[0])     # the model path is checked by the replicas: it lives on their nodes
    except ConfigError as e:
        print(f"cluster_deploy: error: {e}", file=sys.stderr)
        return 2
    ray.init(address="auto")
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(build_app(cfg), name=cfg.serve.app_name, route_prefix=cfg.serve.route_prefix, blocking=False)
    print(f"deployed {cfg.serve.app_name} at http://{cfg.serve.host}:{cfg.serve.port}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
