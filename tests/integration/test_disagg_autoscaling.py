"""Per-pool autoscaling of a P/D app on a real Ray Serve (autoscale/pools.py through Serve's custom-policy hook):
concurrent long streams, each prefilled by the prefill pool, drive the decode pool from 1 to 2 replicas on its
running sequences while the prefill pool (autoscaling off for it) stays at 1; when the load stops the decode pool
returns to 1. Every request completes whole."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running
from tests.integration.outcomes import Outcome, send
from tests.integration.pool_scaling import debug_state, scale_out_and_in

# scaling out and back in takes 30-100 s here; 600 s leaves room for a CI machine 2.5x slower than usual (the
# default 300 s was hit once at load 12)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "affinity-disagg-autoscale"


def test_the_decode_pool_scales_out_and_in_on_its_own_load_and_the_prefill_pool_stays(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, max_ongoing_requests=8,
                     # a replica scaled in finishes its streams (5 s each on a loaded machine: past 3 s, one was cut)
                     graceful_shutdown_timeout_s=30.0)
    # SLOs out of reach, configured capacity: one decode replica "decodes" 3 sequences; 6 streaming clients
    # need 2 (the pool's max); one light client fits in 1. Short windows and delays (look-back 1 s, the
    # replicas' signal window 3 s: the request rate it reports falls that soon after the load stops).
    cfg["autoscaling"] = {"enabled": True, "policy": "engine", "online_capacity": False,
                          "prefill_tokens_per_s": 1e6, "ttft_slo_s": 30.0, "tpot_slo_s": 30.0,
                          "upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "metrics_interval_s": 0.25,
                          "look_back_period_s": 1.0, "min_replicas": 1, "max_replicas": 2,
                          "decode_seqs_per_replica": 3.0, "signal_window_s": 3.0}
    cfg["disaggregation"] = {"enabled": True, "min_remote_prefill_tokens": 8, "transfer_timeout_s": 5.0,
                             "prefill": {"num_replicas": 1, "autoscaling": {"enabled": False}},
                             "decode": {"num_replicas": 1}}
    serve.run(build_app(cfg), name=APP, route_prefix="/disagg-autoscale")
    url = f"{ray_serve}/disagg-autoscale"
    stop, light_stop = threading.Event(), threading.Event()
    outcomes: list[Outcome] = []

    def client(i: int, until: threading.Event) -> None:
        with httpx.Client(timeout=60) as c:
            j = 0
            while not until.is_set():
                prompt = [5 + i, 6 + j % 50, *range(20, 36)]          # 18 tokens: the prefill pool prefills
                outcomes.append(send(c, url, prompt, 60, stream=j % 3 != 2))
                j += 1

    try:
        wait_running(APP, "LLMReplica", 1)
        wait_running(APP, "PrefillReplica", 1)
        light = threading.Thread(target=client, args=(0, light_stop), daemon=True)
        heavy = [threading.Thread(target=client, args=(i, stop), daemon=True) for i in range(1, 6)]
        seen = scale_out_and_in(APP, "LLMReplica", "PrefillReplica", heavy, stop, light, light_stop)
        bad = [o for o in outcomes if not o.completed]
        assert outcomes and not bad, [(o.status, o.transport_error, o.payloads[-2:]) for o in bad[:5]]
        served = {o.replica for o in outcomes if o.replica}
        assert len(served) == 2, served                 # the second decode replica took requests
        state = debug_state(APP, "LLMReplica")
        assert state["disaggregation"]["remote"] > 0    # decodes of prompts the prefill pool prefilled
        print(f"decode/prefill replicas {seen}; {len(outcomes)} requests")
    finally:
        stop.set()
        light_stop.set()
        serve.delete(APP)
