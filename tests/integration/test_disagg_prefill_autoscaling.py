"""The prefill pool of a P/D app scaling on a real Ray Serve (autoscale/pools.py through Serve's custom-policy
hook): clients sending long uncached prompts build a prefill backlog (prompt tokens queued at the prefill
replica, prefilled in small chunks) and a prefill rate that one prefill replica cannot serve within the TTFT
SLO at the configured prefill rate, so the prefill pool goes from 1 to 2 replicas while the decode pool (same
policy, its decode capacity far from reached) stays at 1; when the long prompts stop (a client's short prompts,
which the decode replica prefills itself, keep the app busy) the prefill pool returns to 1. Every request
completes whole, and both pools end with every KV block free. Each pool's decisions are on /metrics."""
from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import app_config, wait_running
from tests.integration.outcomes import Outcome, send
from tests.integration.pool_scaling import debug_state, scale_out_and_in
from tests.integration.waiting import wait_until

# scaling out and back in takes 30-100 s here; 600 s leaves room for a CI machine 2.5x slower than usual (the
# default 300 s was hit once at load 12)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "affinity-disagg-prefill-autoscale"
MIN_REMOTE = 16


def _state(deployment: str) -> dict:
    return debug_state(APP, deployment)


def _pools_empty() -> bool:
    for dep in ("LLMReplica", "PrefillReplica"):
        st = _state(dep)
        if st["num_free_blocks"] != st["num_blocks"] - 1 or st["num_requests"]:
            return False
    return True


def _autoscaler_current(c: httpx.Client, url: str) -> dict[str, float]:
    """affinity_autoscaler_current_replicas on the app's /metrics, by deployment."""
    text = c.get(f"{url}/metrics").text
    return {s.labels["deployment"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "affinity_autoscaler_current_replicas"}


def test_the_prefill_pool_scales_out_and_in_on_its_backlog_and_the_decode_pool_stays(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, max_ongoing_requests=8,
                     # a replica scaled in finishes its streams (5 s each on a loaded machine: past 3 s, one was cut)
                     graceful_shutdown_timeout_s=30.0)
    cfg["engine"]["cache"]["num_blocks"] = 512
    # Paced steps (30 ms, engine.pace): the same prompts queued, the CPU left to the replica starting
    cfg["engine"]["pace"] = {"enabled": True, "step_base_s": 0.03}
    # Configured capacities (online_capacity off): one prefill replica is taken to prefill 300 tokens/s, so
    # 4 clients' 120-token prompts (a few per second each) plus what queues in the prefill engine against a
    # 1 s TTFT SLO need 2; the decode pool is taken to prefill 1e6 tokens/s and decode 100 sequences, out of
    # reach. Short windows and delays (look-back 1 s, the replicas' signal window 3 s: the prefill rate they
    # report falls that soon after the long prompts stop).
    cfg["autoscaling"] = {"enabled": True, "policy": "engine", "online_capacity": False,
                          "ttft_slo_s": 1.0, "tpot_slo_s": 30.0, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                          "metrics_interval_s": 0.25, "look_back_period_s": 1.0, "min_replicas": 1,
                          "max_replicas": 2, "trend_lead_s": 0.0, "cache_loss_headroom": False,
                          "signal_window_s": 3.0}
    cfg["disaggregation"] = {
        "enabled": True, "min_remote_prefill_tokens": MIN_REMOTE, "transfer_timeout_s": 5.0,
        "prefill": {"num_replicas": 1, "autoscaling": {"prefill_tokens_per_s": 300.0},
                    "engine": {"scheduler": {"max_num_batched_tokens": 32}}},      # prompts queue, chunked
        "decode": {"num_replicas": 1, "autoscaling": {"prefill_tokens_per_s": 1e6, "decode_seqs_per_replica": 100.0}}}
    serve.run(build_app(cfg), name=APP, route_prefix="/disagg-prefill-autoscale")
    url = f"{ray_serve}/disagg-prefill-autoscale"
    heavy_stop, light_stop = threading.Event(), threading.Event()
    outcomes: list[Outcome] = []

    def heavy(i: int) -> None:                      # long uncached prompts: the prefill pool prefills them
        rng = random.Random(i)
        with httpx.Client(timeout=60) as c:
            j = 0
            while not heavy_stop.is_set():
                prompt = [rng.randrange(10, 700) for _ in range(120)]
                outcomes.append(send(c, url, prompt, 8, stream=j % 2 == 0))
                j += 1

    def light() -> None:                            # short prompts: the decode replica prefills them itself
        with httpx.Client(timeout=60) as c:
            j = 0
            while not light_stop.is_set():
                outcomes.append(send(c, url, [5, 6 + j % 50, 7, 8], 16, stream=j % 2 == 0))
                j += 1
                time.sleep(0.2)

    try:
        wait_running(APP, "LLMReplica", 1)
        wait_running(APP, "PrefillReplica", 1)
        # each pool's policy puts its decisions on the app's /metrics under its own deployment
        with httpx.Client(timeout=30) as c:
            wait_until(lambda: _autoscaler_current(c, url) == {"LLMReplica": 1, "PrefillReplica": 1}, 30,
                       "both pools' autoscaler series on /metrics")
        threads = [threading.Thread(target=heavy, args=(i,), daemon=True) for i in range(4)]
        light_thread = threading.Thread(target=light, daemon=True)
        seen = scale_out_and_in(APP, "PrefillReplica", "LLMReplica", threads, heavy_stop, light_thread, light_stop)
        bad = [o for o in outcomes if not o.completed]
        assert outcomes and not bad, [(o.status, o.transport_error, o.payloads[-2:]) for o in bad[:5]]
        state = _state("LLMReplica")["disaggregation"]
        # long prompts prefilled by the prefill pool, short ones here, none recomputed after a failed prefill
        assert state["remote"] > 0 and state["local_short"] > 0 and not state["prefill_failed"], state
        wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")
        print(f"prefill/decode replicas {seen}; {len(outcomes)} requests; decode replica's P/D counts {state}")
    finally:
        heavy_stop.set()
        light_stop.set()
        serve.delete(APP)
