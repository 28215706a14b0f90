"""One Ray + Serve per test session on 127.0.0.1; apps are deployed once and shared."""
from __future__ import annotations

import os
import time

import pytest
from tests.ports import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

APP = "affinity"
SECURE_APP = "affinity-secure"
ROUTING_APP = "affinity-routing"
API_KEY = "test-secret-key"


@pytest.fixture(scope="session")
def ray_serve():
    import ray
    from ray import serve

    port = free_port()
    # address="local": always a fresh cluster of our own, even when another Ray runs on the machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def app_config(model: str, **serve_overrides) -> dict:
    serve_cfg = dict(num_replicas=2, replica_num_cpus=0.5, max_ongoing_requests=16, max_queued_requests=64,
                     health_check_period_s=1.0, health_check_timeout_s=5.0, graceful_shutdown_timeout_s=3.0,
                     first_token_timeout_s=20.0, model_name="tiny-llama")
    serve_cfg.update(serve_overrides)
    return {"engine": {"model": model, "num_threads": 1, "cache": {"num_blocks": 256, "block_size": 4},
                       "scheduler": {"max_num_batched_tokens": 256, "max_num_seqs": 32}},
            "serve": serve_cfg,
            "routing": {"request_routing_stats_period_s": 0.5},
            "observability": {"traces": "memory"}}


@pytest.fixture(scope="session")
def app_url(ray_serve, checkpoints):
    """The main app: 2 replicas of a tiny llama, at /."""
    from ray import serve

    from affinity_serve.app.builder import build_app

    serve.run(build_app(app_config(checkpoints["llama"])), name=APP, route_prefix="/")
    _wait_running(APP, "LLMReplica", 2)
    return ray_serve


@pytest.fixture(scope="session")
def secure_url(ray_serve, checkpoints):
    """A second app with an API key, a tiny admission limit (1 ongoing + 1 queued) and Retry-After 3."""
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, api_key=API_KEY, max_ongoing_requests=1,
                     max_queued_requests=1, graceful_shutdown_timeout_s=30.0, retry_after_s=3)
    serve.run(build_app(cfg), name=SECURE_APP, route_prefix="/secure")
    _wait_running(SECURE_APP, "LLMReplica", 1)
    return ray_serve + "/secure"


@pytest.fixture(scope="session")
def routing_url(ray_serve, checkpoints):
    """The routing app at /routing: 2 model replicas of 4 ongoing requests each (a hot prefix saturates
    one), a small KV pool, 2 ingress replicas (each runs its own router), events pulled every 0.25 s."""
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], ingress_replicas=2, max_ongoing_requests=4)
    # hot_share_min_requests: a dozen sequential repeats of one prefix are all this app's traffic, so by
    # default they would count as a busy group and be spread over both replicas (the share rule, which unit
    # tests and the simulator cover); the affinity tests here check that repeats stay on the holder.
    cfg["routing"] |= {"policy": "prefix_affinity", "kv_events_period_s": 0.25,
                       "affinity": {"hot_share_min_requests": 64}}
    serve.run(build_app(cfg), name=ROUTING_APP, route_prefix="/routing")
    _wait_running(ROUTING_APP, "LLMReplica", 2)
    _wait_running(ROUTING_APP, "Ingress", 2)
    return ray_serve + "/routing"


_shared_cli: list = []


@pytest.fixture(scope="session")
def cli_server(checkpoints, tmp_path_factory):
    """An `affinity-serve serve` subprocess (tests/integration/cli_process.py) shared by the CLI tests that only
    talk to it: started on first use, stopped as soon as the next test does not use it (see
    pytest_runtest_teardown), so it holds no Ray for the rest of the session."""
    from tests.integration.cli_process import SharedCLI
    shared = SharedCLI(checkpoints, tmp_path_factory.mktemp("cli"))
    _shared_cli.append(shared)
    yield shared
    shared.stop()


def pytest_runtest_teardown(item, nextitem):
    if _shared_cli and "cli_server" not in getattr(nextitem, "fixturenames", ()):
        _shared_cli[0].stop()


MULTINODE_SCENARIOS = "tests.integration.multinode_scenarios"
_background: dict = {}


@pytest.fixture(scope="session", autouse=True)
def multinode_in_background(request, tmp_path_factory):
    """When this session will assert on `multinode_results`, its scenario starts with the first Ray test, in the
    background at nice 10 (it and the simulated cluster it starts), so it runs in the CPU time the tests before
    it leave idle while they wait on replica start-ups and timers, and takes none from their timing bounds. Its
    own timed part (routing choices, streams failing fast on a node's removal) waits at `wait_for_go` until
    `multinode_results` asks for the result, so it does not run starved beside those tests either."""
    if not any("multinode_results" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield
        return
    from tests.integration.subprocess_scenario import BackgroundScenario
    _background["multinode"] = bg = BackgroundScenario(MULTINODE_SCENARIOS, tmp_path_factory.mktemp("multinode"),
                                                       nice=10)
    yield
    bg.stop()
    _background.clear()


@pytest.fixture(scope="session")
def multinode_results(tmp_path_factory):
    """{"disagg": ..., "multinode": ...}: the results of tests/integration/multinode_scenarios.py, both
    multi-node scenarios run once, in a subprocess, on one simulated cluster (building it costs as much as a
    scenario); test_disagg_multinode.py and test_multinode.py assert on them. Started in the background with
    the session's first Ray test (`multinode_in_background`), or here if it was not."""
    from tests.integration.subprocess_scenario import BackgroundScenario
    bg = _background.get("multinode") or BackgroundScenario(MULTINODE_SCENARIOS, tmp_path_factory.mktemp("multinode"))
    # below the 660 s the tests using it allow (the first test's setup waits for it), so a stuck scenario fails
    # with its stderr; the scenario's timed part runs within it (it waits at wait_for_go until here), so this is
    # its bound. Generous: on a CI machine 2.5x slower than usual, a nice-10 scenario needed over 285 s
    return bg.result(600)


def _wait_running(app: str, deployment: str, n: int, timeout_s: float = 120) -> None:
    from ray import serve
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = serve.status().applications.get(app)
        if st is not None:
            dep = st.deployments.get(deployment)
            if dep is not None and dep.replica_states.get("RUNNING", 0) == n and len(dep.replica_states) == 1:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{app}/{deployment} did not reach {n} running replicas")


wait_running = _wait_running
