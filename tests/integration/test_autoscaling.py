"""The engine-aware autoscaling policy on a real Ray Serve: a step of concurrent requests drives LLMReplica
from 1 to 3 replicas through Serve's custom-policy hook (the replicas' record_autoscaling_stats ->
EngineAwarePolicy), and after the load stops it returns to min_replicas; no request fails."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running

pytestmark = pytest.mark.slow

APP = "affinity-autoscale"


def _running(app: str) -> int:
    from ray import serve
    st = serve.status().applications.get(app)
    dep = st.deployments.get("LLMReplica") if st else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def test_load_scales_out_to_three_and_back_to_one_with_no_failures(ray_serve, checkpoints):
    from ray import serve

    from app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, max_ongoing_requests=8)
    # one replica "decodes" 2 sequences within its TPOT SLO: 8 concurrent streams need ceil(8/2/0.8) = 5,
    # capped at 3; idle, the fleet fits in 1 again after downscale_delay_s
    cfg["autoscaling"] = {"enabled": True, "policy": "engine", "min_replicas": 1, "max_replicas": 3,
                          "decode_seqs_per_replica": 2.0, "prefill_tokens_per_s": 1e6, "ttft_slo_s": 30.0,
                          "tpot_slo_s": 30.0, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                          "metrics_interval_s": 0.25, "look_back_period_s": 1.0}
    serve.run(build_app(cfg), name=APP, route_prefix="/autoscale")
    wait_running(APP, "LLMReplica", 1)
    url = f"{ray_serve}/autoscale/v1/completions"
    stop = threading.Event()
    statuses: list[int] = []
    counts: list[tuple[float, int]] = []

    def client(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            j = 0
            while not stop.is_set():
                body = {"prompt": [5 + i, 6 + j % 50, 7, 8], "max_tokens": 24, "ignore_eos": True,
                        "temperature": 0, "stream": j % 2 == 0}
                r = c.post(url, json=body)
                statuses.append(r.status_code)
                j += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    try:
        for t in threads:
            t.start()
        while time.monotonic() - t0 < 75 and _running(APP) < 3:   # replica start-up dominates on a busy machine
            counts.append((time.monotonic() - t0, _running(APP)))
            time.sleep(0.25)
        reached = _running(APP)
        time.sleep(1.0)                         # a little load at 3 replicas
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    t_up = time.monotonic() - t0
    assert reached == 3, f"replica counts seen: {counts}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(APP) != 1:
        time.sleep(0.25)
    t_down = time.monotonic() - t0 - t_up
    try:
        assert _running(APP) == 1, "did not return to min_replicas after the load stopped"
        assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        print(f"1 -> 3 replicas in {t_up:.1f} s under load ({len(statuses)} requests), back to 1 in "
              f"{t_down:.1f} s")
    finally:
        serve.delete(APP)
