"""Waiting for a Serve deployment's replicas, shared by the benchmarks that start real Serve apps."""

from __future__ import annotations

import time


def wait_running(app: str, deployment: str, n: int, timeout_s: float = 120) -> None:
    """Block until `app`/`deployment` has exactly `n` replicas RUNNING and none in another state (starting,
    stopping); TimeoutError naming both after `timeout_s`."""
    from ray import serve
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = serve.status().applications.get(app)
        dep = st.deployments.get(deployment) if st is not None else None
        if dep is not None and dep.replica_states.get("RUNNING", 0) == n and len(dep.replica_states) == 1:
            return
        time.sleep(0.25)
    raise TimeoutError(f"{app}/{deployment} did not reach {n} running replicas")
