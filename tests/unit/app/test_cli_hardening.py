"""Issue 33.7, 33.9, 33.10, 33.11: which Ray `serve` starts and how it binds it, the API key's path (never
printed, never in argv, never stored in clear in Serve's config) and the API description routes."""
from __future__ import annotations

import json
import pickle

import pytest
import ray
from ray._private import ray_constants

from affinity_serve.app.cli import API_KEY_ENV, main, ready_message
from affinity_serve.app.config import AppConfig
from affinity_serve.app.http import HTTP_LIMITS_ENV, PROXY_CALLBACK_ENV


class _Stop(Exception):
    pass


@pytest.fixture
def ray_init(monkeypatch):
    """ray.init records its kwargs and stops the command there; Ray's environment is restored after."""
    calls: list[dict] = []

    def fake(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop
    monkeypatch.setattr(ray, "init", fake)
    for var in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_AUTH_MODE", API_KEY_ENV,
                PROXY_CALLBACK_ENV, HTTP_LIMITS_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    return calls


# ---------------------------------------------------------------- findings 7 and 9
def test_serve_starts_its_own_loopback_ray_with_authentication_on(checkpoints, ray_init, capsys, monkeypatch):
    with pytest.raises(_Stop):
        main(["serve", "--model", checkpoints["llama"]])
    (kw,) = ray_init
    assert kw["address"] == "local"                          # never a cluster some `ray start` left recorded
    assert kw["_node_ip_address"] == "127.0.0.1"
    # the dashboard (Ray's `serve status`, issue 32.3) on loopback only; --no-dashboard switches it off
    assert (kw["include_dashboard"], kw["dashboard_host"], kw["dashboard_port"]) == (True, "127.0.0.1", 8265)
    assert kw["runtime_env"] == {"worker_process_setup_hook": "affinity_serve.app.cli.loopback_worker_setup"}
    import os
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
    assert "RAY_AUTH_MODE" not in os.environ                 # Ray's token authentication is not switched off
    assert os.environ[PROXY_CALLBACK_ENV] == "affinity_serve.app.http:proxy_middlewares"      # the proxy's HTTP limits
    assert json.loads(os.environ[HTTP_LIMITS_ENV])["body_read_timeout_s"] == 15.0
    assert "starting a local Ray of its own on 127.0.0.1" in capsys.readouterr().out
    with pytest.raises(_Stop):
        main(["serve", "--model", checkpoints["llama"], "--no-dashboard"])
    assert ray_init[1]["include_dashboard"] is False and "dashboard_host" not in ray_init[1]


def test_the_worker_hook_binds_serve_replicas_grpc_server_to_loopback(monkeypatch):
    """Serve 2.60 binds each replica's inter-deployment gRPC server to "[::]:0" (every interface)."""
    from ray.serve._private import replica

    from affinity_serve.app.cli import loopback_worker_setup
    seen: list[str] = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: seen.append(address) or 1)
    loopback_worker_setup()
    loopback_worker_setup()                                  # idempotent
    replica.add_port_to_grpc_server(None, "[::]:0")
    replica.add_port_to_grpc_server(None, "10.0.0.1:5")
    assert seen == ["127.0.0.1:0", "10.0.0.1:5"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_joins_a_cluster_only_when_asked(checkpoints, ray_init, capsys, monkeypatch, how):
    argv = ["serve", "--model", checkpoints["llama"]]
    if how == "flag":
        argv += ["--address", "10.1.2.3:6379"]
    else:
        monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    with pytest.raises(_Stop):
        main(argv)
    (kw,) = ray_init
    assert kw["address"] == "10.1.2.3:6379" and "num_cpus" not in kw and "num_gpus" not in kw
    assert "connecting to the Ray cluster at 10.1.2.3:6379" in capsys.readouterr().out


# ---------------------------------------------------------------- finding 10
def test_the_key_comes_from_the_environment_or_a_file_and_is_never_printed(checkpoints, ray_init, capsys,
                                                                         monkeypatch, tmp_path):
    from affinity_serve.app import cli
    seen: list = []
    monkeypatch.setattr(cli, "check_model", lambda cfg, **kw: seen.append(cfg))
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env-0123456789")
    with pytest.raises(_Stop):
        main(["serve", "--model", checkpoints["llama"]])
    assert seen[-1].serve.api_key.get_secret_value() == "sk-from-env-0123456789"
    (tmp_path / "key").write_text("sk-from-file-0123456789\n")
    with pytest.raises(_Stop):
        main(["serve", "--model", checkpoints["llama"], "--api-key-file", str(tmp_path / "key")])
    assert seen[-1].serve.api_key.get_secret_value() == "sk-from-file-0123456789"
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(_Stop):
        main(["serve", "--model", checkpoints["llama"], "--api-key", "sk-argv-0123456789"])
    out, err = capsys.readouterr()
    assert "--api-key shows the key" in err
    for key in ("sk-from-env-0123456789", "sk-from-file-0123456789", "sk-argv-0123456789"):
        assert key not in out + err
    msg = ready_message(seen[-1])
    assert "sk-argv" not in msg and f"Authorization: Bearer ${API_KEY_ENV}" in msg
    msg = ready_message(seen[-1], key_file="/run/my keys/k")        # the curl line reads the file it came from
    assert "sk-argv" not in msg and "Authorization: Bearer $(cat '/run/my keys/k')" in msg


def test_the_key_is_masked_in_the_config_command_and_in_reprs(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"serve": {"api_key": "sk-in-yaml-0123456789"}}))
    assert main(["config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "sk-in-yaml" not in out and "api_key: '**********'" in out
    cfg = AppConfig.from_yaml(p)
    assert "sk-in-yaml" not in repr(cfg) and "sk-in-yaml" not in str(cfg.model_dump())


def test_serve_stores_only_a_digest_of_the_key(checkpoints):
    """What Serve keeps (the deployments' pickled arguments, in the controller and the GCS) holds no key."""
    from affinity_serve.app.builder import build_app
    key = "sk-never-stored-0123456789"
    app = build_app({"engine": {"model": checkpoints["llama"]}, "serve": {"api_key": key}})
    blob = pickle.dumps((app._bound_deployment.init_args, app._bound_deployment.init_kwargs))
    assert key.encode() not in blob and key[::-1].encode() not in blob
    digest = app._bound_deployment.init_args[2]
    assert digest.matches(key) and not digest.matches(key + "x") and key not in repr(digest)


async def test_the_ingress_checks_the_digest(checkpoints):
    from tests.unit.app.test_hostile_inputs import http_request, ingress
    from affinity_serve.app.prompts import RequestKind
    ing, _ = ingress(checkpoints, api_key="sk-good-0123456789")
    assert ing.cfg.serve.api_key is None                          # dropped from the ingress's config
    body = b'{"prompt": [[1, 2]], "max_tokens": 1}'
    for headers, status in [({}, 401), ({"authorization": "Bearer sk-bad"}, 401),
                            ({"authorization": "Bearer sk-good-0123456789"}, 200),
                            ({"authorization": "bearer  sk-good-0123456789"}, 200)]:
        r = await ing._http(RequestKind.COMPLETION, http_request(body, headers=headers))
        assert r.status_code == status, headers


# ---------------------------------------------------------------- finding 11
async def test_api_description_routes_are_off_when_a_key_is_set(checkpoints):
    from starlette.exceptions import HTTPException
    from tests.unit.app.test_hostile_inputs import http_request, ingress
    keyed, _ = ingress(checkpoints, api_key="sk-0123456789abcdef")
    open_, _ = ingress(checkpoints)
    routes = ["http_openapi", "http_docs", "http_docs_redirect", "http_redoc"]
    for name in routes:
        with pytest.raises(HTTPException) as e:
            await getattr(keyed, name)(http_request(b"", path="/docs", method="GET"))
        assert e.value.status_code == 404
        r = await getattr(open_, name)(http_request(b"", path="/docs", method="GET"))
        assert r.status_code == 200
    spec = json.loads((await open_.http_openapi(http_request(b"", method="GET"))).body)
    assert "/v1/chat/completions" in spec["paths"] and "/docs" not in spec["paths"]


# ------------------------------------------------- Ctrl-C that Ray swallows during start-up
@pytest.mark.parametrize("swallowed_in", ["start_serve", "serve.run"])
def test_a_ctrl_c_that_ray_swallows_during_start_up_still_stops_it(checkpoints, ray_init, capsys, monkeypatch,
                                                                    swallowed_in):
    """make test once saw Ctrl-C land while Serve started: the KeyboardInterrupt never reached the CLI, the app
    deployed and the CLI waited for a signal that had already come. A start-up step that swallows the
    interrupt (as Ray's calls can) must still end in the one-line stop with status 130, Serve not deployed
    after the step that saw it, and Ray stopped."""
    import signal

    from ray import serve

    from affinity_serve.app import cli
    calls: list[str] = []

    def swallowing(name):
        def step(*args, **kwargs):
            calls.append(name)
            if name == swallowed_in:
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass                          # what a Ray call that catches everything does
        return step
    monkeypatch.setattr(cli, "init_ray", swallowing("init_ray"))
    monkeypatch.setattr(cli, "start_serve", swallowing("start_serve"))
    monkeypatch.setattr(serve, "run", swallowing("serve.run"))
    monkeypatch.setattr(cli, "_stop_ray", lambda: calls.append("stop_ray"))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        rc = main(["serve", "--model", checkpoints["llama"]])
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    out = capsys.readouterr().out
    assert rc == 130
    assert calls == {"start_serve": ["init_ray", "start_serve", "stop_ray"],
                     "serve.run": ["init_ray", "start_serve", "serve.run", "stop_ray"]}[swallowed_in]
    assert [l.strip() for l in out.splitlines() if "interrupted" in l] == [
        "[affinity-serve] interrupted during start-up; stopped."]
    assert "Ctrl-C to stop" not in out


def test_an_exposed_address_without_a_key_and_a_short_key_draw_warnings():
    from affinity_serve.app.cli import exposure_warnings
    assert exposure_warnings(AppConfig()) == []
    [w] = exposure_warnings(AppConfig.model_validate({"serve": {"host": "0.0.0.0"}}))
    assert "0.0.0.0 without an API key" in w and "port 8000" in w
    assert exposure_warnings(AppConfig.model_validate({"serve": {"host": "0.0.0.0",
                                                                  "api_key": "k" * 32}})) == []
    [w] = exposure_warnings(AppConfig.model_validate({"serve": {"api_key": "tiny-key"}}))
    assert "8 characters" in w and "tiny-key" not in w                   # the key itself is never printed
