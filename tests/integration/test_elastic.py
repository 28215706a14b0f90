"""Elasticity on a real Ray Serve: scale-out and scale-in under a steady load of streaming and plain requests
lose nothing; a replica stopped past its graceful timeout ends its streams with an in-band error event and
[DONE] (plain requests: 503 + Retry-After); with min_replicas 0 a request waits for a cold start within
serve.cold_start_timeout_s and gets a 503 in the OpenAI envelope when none comes."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running
from tests.integration.outcomes import Outcome, send
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow

ELASTIC_APP = "affinity-elastic"
FORCED_APP = "affinity-forced"
ZERO_APP = "affinity-zero"
NEVER_APP = "affinity-never"


def _scale(app: str, n: int) -> None:
    """Set LLMReplica's replica count through Serve's external-scaler API (only that deployment changes)."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client
    ray.get(_get_global_client()._controller.update_deployment_replicas.remote(
        DeploymentID(name="LLMReplica", app_name=app), n))


def _deploy(cfg: dict, app: str, prefix: str, *, external_scaler: bool = True, replica_options=None) -> None:
    from ray import serve

    from affinity_serve.app.builder import build_app, ingress_deployment, replica_deployment, resolve_model
    from affinity_serve.app.config import AppConfig
    if replica_options is None:
        serve.run(build_app(cfg), name=app, route_prefix=prefix, external_scaler_enabled=external_scaler)
        return
    # build_app's graph, with Serve options the config cannot express (initial_replicas 0)
    c = resolve_model(AppConfig.model_validate(cfg))
    replica = replica_deployment(c).options(**replica_options).bind(c.engine.to_engine_config(), c.serve,
                                                                     c.observability)
    serve.run(ingress_deployment(c).bind(replica, c), name=app, route_prefix=prefix)


def _prompt(group: int, j: int) -> list[int]:
    rng = random.Random(group)
    return [rng.randrange(5, 600) for _ in range(24)] + [600 + j % 100, 700 + j // 100 % 50]


class SteadyLoad:
    """`workers` clients sending back to back, alternating SSE streams and plain requests (out of step with
    each other); two of three share one of 2 prefixes (affinity traffic), every third brings a new prefix
    (a new group, which a replica that joined gets first)."""

    def __init__(self, url: str, workers: int = 4):
        self.url = url
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self.threads = [threading.Thread(target=self._work, args=(i,)) for i in range(workers)]

    def _work(self, i: int) -> None:
        with httpx.Client(timeout=60) as c:
            j = 0
            while not self.stop.is_set():
                group = i % 2 if j % 3 else 1000 + 100 * i + j
                # half the workers start with a stream, half with a plain request, so that some stream is
                # in flight at any moment (in step, all four were sometimes between streams at once)
                streaming = (i + j) % 2 == 0
                self.outcomes.append(send(c, self.url, _prompt(group, j * 7 + i), 64 if streaming else 32,
                                              stream=streaming))
                j += 1

    def __enter__(self) -> "SteadyLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def _routers(app: str) -> list[dict]:
    from ray import serve
    return serve.get_app_handle(app).routing_decisions.remote(1).result(timeout_s=30)["routers"]


@pytest.fixture(scope="module")
def elastic_url(ray_serve, checkpoints):
    from ray import serve
    cfg = app_config(checkpoints["llama"], num_replicas=1, graceful_shutdown_timeout_s=20.0)
    # Paced steps (30 ms, engine.pace): the same load in flight, the CPU left to the replicas starting under it
    cfg["engine"]["pace"] = {"enabled": True, "step_base_s": 0.03}
    _deploy(cfg, ELASTIC_APP, "/elastic")
    wait_running(ELASTIC_APP, "LLMReplica", 1)
    yield ray_serve + "/elastic"
    serve.delete(ELASTIC_APP)


def test_scale_out_and_in_under_load_fails_nothing(elastic_url):
    with SteadyLoad(elastic_url) as load:
        outs = load.outcomes
        wait_until(lambda: len([o for o in outs if o.completed]) >= 4, 60, "the load to get going")
        t_out = time.monotonic()
        original = {o.replica for o in outs if o.end < t_out}
        _scale(ELASTIC_APP, 3)
        wait_running(ELASTIC_APP, "LLMReplica", 3, timeout_s=120)     # start-up: 45 s seen on a loaded machine
        t_up = time.monotonic()
        # Serve announces the new replicas to the router on its own time: wait until they took traffic and
        # the router warmed each (its warm-up call, off the request path, would fail on a replica stopped
        # first), both asserted below
        wait_until(lambda: len({o.replica for o in outs if o.start > t_out and o.replica}) >= 2
                   and sum(r["num_warmups"] for r in _routers(ELASTIC_APP)) == 2, 60,
                   "the new replicas to take traffic and be warmed")
        t_in = time.monotonic()
        _scale(ELASTIC_APP, 1)
        # Serve stops the newest replicas and drops them from every router while they drain: from then on
        # every request goes to the original replica (asserted below)
        survivor = next(iter(original)).removeprefix("replica:") if len(original) == 1 else None
        wait_until(lambda: all(set(r["replicas"]) == {survivor} for r in _routers(ELASTIC_APP)), 60,
                   "the router to drop the stopping replicas")
        t_dropped = time.monotonic()
        wait_running(ELASTIC_APP, "LLMReplica", 1, timeout_s=120)   # the two stopping replicas drained
        t_down = time.monotonic()
        wait_until(lambda: [o for o in outs if o.start > t_dropped], 60, "a request sent after the drop to end")
    print(f"scale-out {t_up - t_out:.1f}s, router dropped the stopping replicas {t_dropped - t_in:.1f}s after the "
          f"scale-in, drain {t_down - t_in:.1f}s, {len(outs)} requests")
    bad = [o for o in outs if not o.completed]
    assert not bad, [(o.status, o.transport_error, o.payloads[-2:]) for o in bad[:5]]
    assert len(original) == 1, original
    assert len({o.replica for o in outs if t_out < o.start < t_in}) >= 2      # the new replicas took traffic
    draining = [o for o in outs if o.stream and o.start < t_in < o.end]
    assert draining, "no stream was in flight when the scale-in began"
    late = [o for o in outs if o.start > t_dropped]
    assert late and {o.replica for o in late} == original
    routers = _routers(ELASTIC_APP)
    assert routers and all(set(r["replicas"]) == {survivor} for r in routers)
    assert sum(r["num_warmups"] for r in routers) == 2       # each joining replica got the hot prefixes
    from ray import serve
    h = serve.get_deployment_handle("LLMReplica", app_name=ELASTIC_APP)
    # every KV block back: the last requests' blocks are freed by the engine's step, on its own time
    st = wait_until(lambda: (s := h.debug_state.remote().result(timeout_s=30))["num_requests"] == 0
                    and s["num_free_blocks"] == s["num_blocks"] - 1 and s, 30, "every KV block back")
    assert st["num_requests"] == 0 and st["num_free_blocks"] == st["num_blocks"] - 1


@pytest.fixture(scope="module")
def forced_url(ray_serve, checkpoints):
    """2 replicas that get 1 s to drain when stopped, with room for 8 long streams each."""
    from ray import serve
    cfg = app_config(checkpoints["llama"], num_replicas=2, graceful_shutdown_timeout_s=1.0)
    cfg["engine"]["cache"]["num_blocks"] = 1200
    _deploy(cfg, FORCED_APP, "/forced")
    wait_running(FORCED_APP, "LLMReplica", 2)
    yield ray_serve + "/forced"
    serve.delete(FORCED_APP)


def test_streams_cut_past_the_graceful_timeout_end_with_an_error_event(forced_url):
    n_streams, n_plain = 16, 4
    outs: list[Outcome] = []
    started = [threading.Event() for _ in range(n_streams)]

    def run(i: int) -> None:
        with httpx.Client(timeout=90) as c:
            stream = i < n_streams
            outs.append(send(c, forced_url, _prompt(100 + i, i), 480, stream,
                                 started[i] if stream else None))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_streams + n_plain)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    _scale(FORCED_APP, 1)
    for t in threads:
        t.join(timeout=120)
    assert len(outs) == n_streams + n_plain and not [o.transport_error for o in outs if o.transport_error]
    streams = [o for o in outs if o.stream]
    cut = [o for o in streams if not o.completed]
    assert cut and len(cut) < len(streams)         # the stopped replica's streams were cut, the others not
    for o in cut:
        err = o.error_event
        assert err is not None, o.payloads[-2:]
        assert err["type"] == "service_unavailable" and err["code"] == "replica_unavailable"
        assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    assert len({o.replica for o in cut}) == 1 and not {o.replica for o in cut} & {
        o.replica for o in streams if o.completed}
    for o in outs:
        if not o.stream:
            assert o.status in (200, 503), o.payloads
            if o.status == 503:
                assert json.loads(o.payloads[0])["error"]["code"] == "replica_unavailable"
                assert o.payloads[1] == "1"                                         # Retry-After
    wait_running(FORCED_APP, "LLMReplica", 1, timeout_s=120)
    with httpx.Client(timeout=60) as c:
        assert send(c, forced_url, _prompt(1, 1), 4, stream=True).completed


def _zero_options(cfg: dict, **autoscaling) -> dict:
    return {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1,
                                   "upscale_delay_s": 0, "downscale_delay_s": 600, **autoscaling}}


def test_scaled_to_zero_with_no_replica_coming_is_a_503_within_the_bound(ray_serve, checkpoints):
    """min_replicas 0 and a replica that can never be placed (it asks for more CPUs than the cluster has):
    the request waits serve.cold_start_timeout_s for one, then gets a 503 in the OpenAI envelope."""
    from ray import serve
    cfg = app_config(checkpoints["llama"], num_replicas=1, replica_num_cpus=1000.0, cold_start_timeout_s=1.0)
    _deploy(cfg, NEVER_APP, "/never", replica_options=_zero_options(cfg))
    try:
        with httpx.Client(timeout=30) as c:
            for stream in (False, True):
                t0 = time.monotonic()
                r = c.post(f"{ray_serve}/never/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                                      "stream": stream})
                took = time.monotonic() - t0
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                err = r.json()["error"]
                assert (err["type"], err["code"]) == ("service_unavailable", "no_replica_running")
                assert 1.0 <= took < 5.0, took
    finally:
        serve.delete(NEVER_APP)


def test_a_request_to_a_deployment_scaled_to_zero_starts_a_replica_and_is_served(ray_serve, checkpoints):
    from ray import serve
    cfg = app_config(checkpoints["llama"], num_replicas=1, cold_start_timeout_s=60.0)
    _deploy(cfg, ZERO_APP, "/zero", replica_options=_zero_options(cfg))
    try:
        st = serve.status().applications[ZERO_APP].deployments["LLMReplica"]
        assert st.replica_states.get("RUNNING", 0) == 0
        with httpx.Client(timeout=90) as c:
            o = send(c, f"{ray_serve}/zero", _prompt(7, 7), 8, stream=True)
        assert o.completed, (o.status, o.payloads[-2:], o.transport_error)
        wait_running(ZERO_APP, "LLMReplica", 1, timeout_s=30)
    finally:
        serve.delete(ZERO_APP)
