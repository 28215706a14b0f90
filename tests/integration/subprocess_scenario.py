"""Multi-node scenarios run in a subprocess: one process can join only one Ray cluster, and a test process may
already hold the session Ray of tests/integration/conftest.py. A scenario module's `main` prints its result as
one JSON line; `run_scenario` runs that module and returns the parsed result."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: every simulated node: 2 CPUs, a small object store, bound to 127.0.0.1
NODE_ARGS = dict(num_cpus=2, object_store_memory=80 * 2**20, node_ip_address="127.0.0.1")


def run_scenario(module: str, workdir: pathlib.Path, timeout_s: float) -> dict:
    """Run `python -m module workdir` from the repository root without the caller's RAY_ADDRESS; AssertionError
    with the tail of its stderr if it fails or runs past `timeout_s`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        proc = subprocess.run([sys.executable, "-m", module, str(workdir)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:      # say where it stood (give timeout_s below pytest's timeout)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"scenario {module} ran past {timeout_s:.0f}s:\n{err[-4000:]}") from None
    assert proc.returncode == 0, f"scenario {module} failed:\n{proc.stderr[-4000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res["timings_s"]))
    return res


def scenario_main(scenario: Callable[[pathlib.Path], dict], argv: list[str]) -> int:
    """A scenario module's entry point: run `scenario(workdir)` and print its result as one JSON line."""
    workdir = pathlib.Path(argv[0]) if argv else pathlib.Path.cwd()
    workdir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(scenario(workdir)), flush=True)
    return 0


def start_cluster(head_resources: dict[str, float], worker_resources: list[dict[str, float]]):
    """(a ray.cluster_utils.Cluster on 127.0.0.1 whose head declares `head_resources`, its worker nodes: one per
    entry of `worker_resources`), every node up."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(**NODE_ARGS, include_dashboard=False,
                                                                resources=head_resources))
    workers = [cluster.add_node(**NODE_ARGS, resources=r) for r in worker_resources]
    cluster.wait_for_nodes()
    return cluster, workers


def connect(cluster) -> int:
    """Join `cluster` and start Serve with its HTTP proxy on the head only (the default proxy_location) on a free
    port of 127.0.0.1; that port."""
    import ray
    from ray import serve
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return port


def shutdown_cluster(cluster) -> None:
    """End a scenario: Serve and this process's Ray connection, then the simulated cluster, whatever fails first."""
    import ray
    from ray import serve
    try:
        serve.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()
