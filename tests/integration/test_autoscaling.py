"""The engine-aware autoscaling policy on a real Ray Serve, through Serve's custom-policy hook (the replicas'
record_autoscaling_stats -> EngineAwarePolicy):
- a step of concurrent requests drives LLMReplica from 1 to 3 replicas; when it ends, a light streaming load
  keeps running while the fleet returns to min_replicas, so streams are in flight during the scale-in; every
  request completes whole (a stream cut by a scale-in would still have status 200, so each is judged by its
  content);
- with min_replicas 0 the policy takes an idle fleet to zero, and the next request starts a replica and is
  served; its decisions are on the app's /metrics (target and current replicas, decisions by reason);
- the app's metrics hub killed, nothing but a process of the app starting creates it again (not the running
  processes' pushes, nor Serve's controller's after the app is deleted)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import app_config, wait_running
from tests.integration.outcomes import Outcome, send
from tests.integration.waiting import wait_until

# scaling out and back in takes 30-100 s here; 600 s leaves room for a CI machine 2.5x slower than usual (the
# default 300 s was hit once at load 12)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "affinity-autoscale"
ZERO_APP = "affinity-autoscale-zero"


def _running(app: str) -> int:
    from ray import serve
    st = serve.status().applications.get(app)
    dep = st.deployments.get("LLMReplica") if st else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def _autoscaler(c: httpx.Client, url: str) -> dict[tuple[str, str], float]:
    """The app's affinity_autoscaler_* samples for LLMReplica on /metrics: {(sample name, reason or ""): value}."""
    text = c.get(f"{url}/metrics").text
    return {(s.name, s.labels.get("reason", "")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith("affinity_autoscaler_") and s.labels.get("deployment") == "LLMReplica"}


def _fast_engine_policy(**overrides) -> dict:
    """Our policy with short delays and metric windows, SLOs out of reach (only the predicted load acts), on
    the configured capacity priors (learned from the tiny model's steps, a replica decodes far more than 3)."""
    return {"enabled": True, "policy": "engine", "online_capacity": False, "prefill_tokens_per_s": 1e6,
            "ttft_slo_s": 30.0, "tpot_slo_s": 30.0, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
            "metrics_interval_s": 0.25, "look_back_period_s": 1.0, **overrides}


def test_load_scales_out_to_three_and_back_to_one_with_streams_in_flight_and_no_failures(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, max_ongoing_requests=8,
                     # a replica scaled in finishes its streams (5 s each on a loaded machine: past 3 s, one was cut)
                     graceful_shutdown_timeout_s=30.0)
    # Paced steps (30 ms, engine.pace): the replicas hold the same requests in flight but leave the CPU to the
    # replicas starting (on 2 cores, an unpaced replica serving 8 clients slowed each start-up to 11-15 s)
    cfg["engine"]["pace"] = {"enabled": True, "step_base_s": 0.03}
    # One replica "decodes" 3 sequences within its TPOT SLO. 8 concurrent clients: ~8 / 3 = 2.7 units of load
    # need ceil(2.7 / 0.8) = 4 replicas, capped at 3. One client streaming back to back: ~0.33 units, which
    # the down rule (load x 0.8 / 0.5, then the up rule) fits in 1 replica.
    cfg["autoscaling"] = _fast_engine_policy(min_replicas=1, max_replicas=3, decode_seqs_per_replica=3.0)
    serve.run(build_app(cfg), name=APP, route_prefix="/autoscale")
    wait_running(APP, "LLMReplica", 1)
    url = f"{ray_serve}/autoscale"
    heavy_stop, light_stop = threading.Event(), threading.Event()
    outcomes: list[Outcome] = []
    counts: list[tuple[float, int]] = []          # (time, RUNNING replicas) whenever it changed

    def client(i: int, stop: threading.Event, always_stream: bool) -> None:
        with httpx.Client(timeout=60) as c:
            j = 0
            while not stop.is_set():
                stream = always_stream or j % 2 == 0
                outcomes.append(send(c, url, [5 + i, 6 + j % 50, 7, 8], 80 if always_stream else 24, stream))
                j += 1

    def poll(until: int, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            n = _running(APP)
            if not counts or counts[-1][1] != n:
                counts.append((time.monotonic(), n))
            if n == until:
                return
            time.sleep(0.2)

    light = threading.Thread(target=client, args=(0, light_stop, True), daemon=True)
    heavy = [threading.Thread(target=client, args=(i, heavy_stop, False), daemon=True) for i in range(1, 8)]
    t0 = time.monotonic()
    try:
        light.start()
        for t in heavy:
            t.start()
        poll(3, 120)                              # replica start-up dominates on a busy machine
        time.sleep(1.0)                           # a little load at 3 replicas
        heavy_stop.set()
        for t in heavy:
            t.join(timeout=60)
        t_light = time.monotonic()
        poll(1, 90)                               # the light streams keep going through the scale-in
        time.sleep(1.0)
    finally:
        heavy_stop.set()
        light_stop.set()
        for t in [light, *heavy]:
            t.join(timeout=60)
    try:
        seen = [(round(t - t0, 1), n) for t, n in counts]
        assert max(n for _, n in counts) == 3, f"replica counts seen: {seen}"
        assert counts[-1][1] == 1, f"did not return to min_replicas under the light load: {seen}"
        bad = [o for o in outcomes if not o.completed]
        assert outcomes and not bad, [(o.status, o.transport_error, o.payloads[-2:]) for o in bad[:5]]
        # the moments the count fell (3 -> 2 -> 1 or 3 -> 1): a light stream was in flight at one of them
        drops = [t for (t, n), (_, prev) in zip(counts[1:], counts) if n < prev and t > t_light]
        assert drops, f"no scale-in after the heavy load stopped: {seen}"
        in_flight = [o for o in outcomes if o.stream and any(o.start < t < o.end for t in drops)]
        assert in_flight, "no stream was in flight when the fleet scaled in"
        print(f"replica counts {seen}; {len(outcomes)} requests, {len(in_flight)} streams across a scale-in")
        # the hub killed while the app runs: its processes' pushes and Serve's controller's do not create it
        # again (only a process of the app starting does, or a scrape, which an ingress of the live app answers)
        _kill_hub(APP)
        _watch_no_hub(APP, 3.0)
        scrapes: list[httpx.Response] = []
        with httpx.Client(timeout=30) as c:
            wait_until(lambda: scrapes.append(c.get(f"{url}/metrics")) or scrapes[-1].status_code == 200, 60,
                       "a scrape to make the hub again and answer")
        # a scrape is a 503 while the hub cannot be asked or is new (never one process's counts), then the app's
        assert scrapes[0].status_code == 503 and _hub_exists(APP), scrapes[0].text[:300]
        assert all(r.json()["error"]["code"] == "metrics_unavailable" for r in scrapes[:-1])
        assert "affinity_http_requests_total" in scrapes[-1].text
        # nor once the app is deleted, while the controller still pushes the policy's decisions
        # (DECISIONS_STALE_AFTER_S after its last call)
        _kill_hub(APP)
    finally:
        serve.delete(APP)
    from affinity_serve.autoscale.serve_policy import DECISIONS_STALE_AFTER_S
    _watch_no_hub(APP, DECISIONS_STALE_AFTER_S + 2.0)


def _hub_exists(app: str) -> bool:
    import ray

    from affinity_serve.app.metrics_hub import HUB_NAMESPACE, hub_name
    try:
        ray.get_actor(hub_name(app), namespace=HUB_NAMESPACE)
        return True
    except ValueError:
        return False


def _kill_hub(app: str) -> None:
    import ray

    from affinity_serve.app.metrics_hub import HUB_NAMESPACE, hub_name
    ray.kill(ray.get_actor(hub_name(app), namespace=HUB_NAMESPACE))
    wait_until(lambda: not _hub_exists(app), 30, "the killed hub to go")


def _watch_no_hub(app: str, window_s: float) -> None:
    """No hub named for `app` at any look over `window_s` (pushes come every second: a hub created by one
    would show)."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        assert not _hub_exists(app), f"the killed hub of app {app} was created again"
        time.sleep(0.2)


def test_the_policy_scales_an_idle_fleet_to_zero_and_a_request_brings_a_replica_back(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    # a cold start here takes ~8 s on a quiet machine; CI's loaded 2 cores took 59 s for the first deploy
    cfg = app_config(checkpoints["llama"], num_replicas=1, cold_start_timeout_s=240.0)
    cfg["autoscaling"] = _fast_engine_policy(min_replicas=0, max_replicas=1, decode_seqs_per_replica=3.0,
                                             downscale_to_zero_delay_s=2.0, signal_window_s=3.0)
    serve.run(build_app(cfg), name=ZERO_APP, route_prefix="/autoscale-zero")
    url = f"{ray_serve}/autoscale-zero"
    try:
        wait_running(ZERO_APP, "LLMReplica", 1)   # initial_replicas: serve.num_replicas within the bounds
        with httpx.Client(timeout=300) as c:
            first = send(c, url, [5, 6, 7, 8], 8, stream=True)
            assert first.completed, (first.status, first.payloads[-2:], first.transport_error)
            t_idle = time.monotonic()
            # the policy's decisions on /metrics, pushed from Serve's controller (the request keeps the replica
            # for the signal window: no decision to zero before it)
            at_one = wait_until(lambda: (m := _autoscaler(c, url)).get(("affinity_autoscaler_current_replicas", ""))
                                == 1 and m, 15, "the autoscaler's series at one replica on /metrics")
            assert at_one[("affinity_autoscaler_target_replicas", "")] in (0, 1), at_one
            deadline = t_idle + 30
            while time.monotonic() < deadline and _running(ZERO_APP) > 0:
                time.sleep(0.2)
            to_zero_s = time.monotonic() - t_idle
            assert _running(ZERO_APP) == 0, "the idle fleet was not scaled to zero"
            # idle for downscale_to_zero_delay_s (2 s) once the look-back mean (1 s) reads nothing in flight
            # and no request in the replica's signal window (3 s): a request shorter than the metrics
            # interval can fall between in-flight samples, but its first token stays in that window
            assert to_zero_s >= 2.0, to_zero_s
            # and at zero: the count it holds now, and the decision that took the fleet there
            got = wait_until(lambda: (m := _autoscaler(c, url)).get(("affinity_autoscaler_current_replicas", ""))
                             == 0 and m, 15, "the autoscaler's series at zero replicas on /metrics")
            assert got[("affinity_autoscaler_target_replicas", "")] == 0, got
            assert got.get(("affinity_autoscaler_decisions_total", "to_zero"), 0) >= 1, got
            again = send(c, url, [5, 6, 7, 9], 8, stream=True)
            assert again.completed, (again.status, again.payloads[-2:], again.transport_error,
                                     serve.status().applications[ZERO_APP].deployments["LLMReplica"],
                                     _autoscaler(c, url))
            plain = send(c, url, [5, 6, 7, 10], 8, stream=False)
            assert plain.completed, plain.payloads
        print(f"to zero {to_zero_s:.1f} s after the last request; a cold start served in "
              f"{again.end - again.start:.1f} s")
    finally:
        serve.delete(ZERO_APP)
    # deleted: the controller stops pushing the policy's series, so the hub (it outlives the app) drops the
    # gauges; the decision counts stay in its totals
    import ray

    from affinity_serve.app.metrics_hub import HUB_NAMESPACE, hub_name
    hub = ray.get_actor(hub_name(ZERO_APP), namespace=HUB_NAMESPACE)     # detached: it outlived the app
    left = wait_until(lambda: "affinity_autoscaler_target_replicas" not in (t := ray.get(
        hub.render.remote("test-probe", {}, None))) and t, 30, "the deleted deployment's autoscaler gauges to go")
    assert 'affinity_autoscaler_decisions_total{deployment="LLMReplica",reason="to_zero"}' in left, left
