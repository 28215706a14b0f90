"""Multi-node scenarios run in a subprocess: one process can join only one Ray cluster, and a test process may
already hold the session Ray of tests/integration/conftest.py. A scenario module's `main` prints its result as
one JSON line; `BackgroundScenario` runs that module and returns the parsed result."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import signal
import sys
import time
from collections.abc import Callable

from tests.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: every simulated node: 2 CPUs, a small object store, bound to 127.0.0.1
NODE_ARGS = dict(num_cpus=2, object_store_memory=80 * 2**20, node_ip_address="127.0.0.1")


#: the environment variable naming the file whose creation lets a scenario past `wait_for_go`
GO_FILE_ENV = "AFFINITY_SCENARIO_GO_FILE"


class BackgroundScenario:
    """`python -m module workdir` started now, from the repository root without the caller's RAY_ADDRESS, at
    `nice` (added to this process's niceness; inherited by every Ray process the scenario starts), its output
    in files of `workdir`; `result` lets it past `wait_for_go` and waits for it."""

    def __init__(self, module: str, workdir: pathlib.Path, nice: int = 0):
        self.module, self.started = module, time.monotonic()
        self.go_file = workdir / "go"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env[GO_FILE_ENV] = str(self.go_file)
        self.out, self.err = open(workdir / "stdout.txt", "w+"), open(workdir / "stderr.txt", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(workdir)], cwd=ROOT, env=env,
                                     stdout=self.out, stderr=self.err, preexec_fn=(lambda: os.nice(nice)) if nice
                                     else None)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def result(self, timeout_s: float) -> dict:
        """Its parsed last stdout line; AssertionError with the tail of its stderr if it fails or is still
        running `timeout_s` from now (then it is stopped). From here on the caller waits for it: its process
        tree gets the caller's priority back where that is allowed (`renice_tree`)."""
        self.reniced = renice_tree(self.proc.pid, os.nice(0))
        self.go_file.touch()
        try:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.stop()
                ran = time.monotonic() - self.started
                raise AssertionError(f"scenario {self.module} ran past {ran:.0f}s:\n{self._stderr()[-4000:]}") \
                    from None
            assert self.proc.returncode == 0, f"scenario {self.module} failed:\n{self._stderr()[-4000:]}"
            self.out.seek(0)
            res = json.loads(self.out.read().strip().splitlines()[-1])
        finally:
            self.out.close()
            self.err.close()
        print(json.dumps({"started_s_ago": round(time.monotonic() - self.started, 1), "reniced": self.reniced,
                          **res["timings_s"]}))
        return res

    def stop(self) -> None:
        """SIGTERM (the scenario shuts its cluster down: scenario_main), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (from /proc's parent ids; [] where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def renice_tree(root: int, niceness: int) -> int:
    """Set `root`'s process tree (it and the Ray processes it started) to `niceness`; how many processes took it.
    Lowering a niceness needs privilege (root or CAP_SYS_NICE, as on CI): without it the tree keeps its own."""
    done = 0
    for pid in _descendants(root):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
            done += 1
        except ProcessLookupError:      # ended since it was listed
            continue
        except PermissionError:         # lowering without privilege: this one keeps its niceness
            continue
    return done


def wait_for_go(limit_s: float = 900.0) -> float:
    """In a scenario run by BackgroundScenario: wait until its caller asks for the result (the go file exists),
    so the timed part that follows runs while that caller waits instead of beside its work; at most `limit_s`
    (then go on). At once when not run that way. Returns the seconds waited."""
    path = os.environ.get(GO_FILE_ENV)
    t0 = time.monotonic()
    while path and not os.path.exists(path) and time.monotonic() - t0 < limit_s:
        time.sleep(0.2)
    if path and not os.path.exists(path):
        print(f"wait_for_go: no go after {limit_s:.0f}s, going on beside the caller's tests", file=sys.stderr)
    return time.monotonic() - t0


def scenario_main(scenario: Callable[[pathlib.Path], dict], argv: list[str]) -> int:
    """A scenario module's entry point: run `scenario(workdir)` and print its result as one JSON line."""
    workdir = pathlib.Path(argv[0]) if argv else pathlib.Path.cwd()
    workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (BackgroundScenario.stop) unwinds like an exception, so the scenario's `finally` stops its cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
    port = free_port()
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
