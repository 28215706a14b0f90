"""The drive shared by the P/D per-pool autoscaling tests: start the clients, wait for one pool to reach 2
replicas, stop the heavy clients, wait for it to come back to 1, then stop the light one; the replica counts
of both pools are recorded whenever either changes."""
from __future__ import annotations

import threading
import time
from typing import Any


def running(app: str, deployment: str) -> int:
    from ray import serve
    st = serve.status().applications.get(app)
    dep = st.deployments.get(deployment) if st else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def debug_state(app: str, deployment: str) -> dict[str, Any]:
    from ray import serve
    return serve.get_deployment_handle(deployment, app_name=app).debug_state.remote().result(timeout_s=30)


def _served_by_two(app: str, deployment: str, timeout_s: float) -> None:
    """Until two replicas of `deployment` have each given a first token (Serve announces a new replica to the
    routers on its own time, seconds on a loaded machine), or `timeout_s` passed: the callers assert what
    they need of it (the decode pool's test, that both replicas served)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = debug_state(app, deployment)
        seen[st["replica_id"]] = st["signal_totals"]["num_first_tokens"]
        if sum(1 for n in seen.values() if n > 0) >= 2:
            return
        time.sleep(0.2)


def scale_out_and_in(app: str, scaling: str, other: str, heavy: list[threading.Thread], heavy_stop: threading.Event,
                     light: threading.Thread, light_stop: threading.Event) -> list[tuple[float, int, int]]:
    """Runs the load and returns [(seconds since start, `scaling` RUNNING, `other` RUNNING)] at every change;
    asserts `scaling` reached 2 and ended at 1 while `other` stayed at 1."""
    counts: list[tuple[float, int, int]] = []

    def poll(until: int, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            now = (running(app, scaling), running(app, other))
            if not counts or counts[-1][1:] != now:
                counts.append((time.monotonic(), *now))
            if now[0] == until:
                return
            time.sleep(0.2)

    t0 = time.monotonic()
    light.start()
    for t in heavy:
        t.start()
    poll(2, 120)                                 # replica start-up dominates on a busy machine
    if counts[-1][1] == 2:
        _served_by_two(app, scaling, 60)         # requests reach the new replica
    heavy_stop.set()
    for t in heavy:
        t.join(timeout=60)
    poll(1, 90)
    light_stop.set()
    light.join(timeout=60)
    seen = [(round(t - t0, 1), s, o) for t, s, o in counts]
    assert max(s for _, s, _ in seen) == 2, f"{scaling}/{other} replicas seen: {seen}"
    assert seen[-1][1] == 1, f"{scaling} did not return to 1: {seen}"
    assert {o for _, _, o in seen} == {1}, f"{other} moved: {seen}"
    return seen
