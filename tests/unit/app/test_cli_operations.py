"""Issue 32.4 (and 32.1's start-up half): configuration errors that used to arrive as tracebacks are one line
before Ray starts, with exit status 2; the messages read as sentences; Ctrl-C before Ray is one line."""
from __future__ import annotations

import importlib.util
import json
import threading
import logging

import pytest
import ray

from affinity_serve.app.cli import main


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("Ray was started")
    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def no_otlp(monkeypatch):
    """The `otlp` extra is not installed (whether or not it is here)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry.exporter.otlp") else real(name, *a))


@pytest.mark.parametrize("observability", [{"traces": "otlp"}, {"otlp_endpoint": "http://collector:4318"}])
@pytest.mark.parametrize("cmd", ["serve", "config", "deploy"])
def test_otlp_without_its_extra_is_one_line_and_status_2(checkpoints, tmp_path, capsys, no_otlp, cmd,
                                                        observability):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": {"model": checkpoints["llama"]}, "observability": observability}))
    assert main([cmd, "--config", str(p)]) == 2
    err = capsys.readouterr().err
    key = "observability.traces: 'otlp'" if "traces" in observability else \
        "observability.otlp_endpoint: 'http://collector:4318'"
    assert err == (f"affinity-serve: error: invalid configuration: {key} needs the 'otlp' extra, which is not "
                   "installed: pip install 'affinity-serve[otlp]'\n")


def test_a_check_of_the_effective_configuration_reads_as_a_sentence(checkpoints, tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": {"model": checkpoints["llama"], "max_model_len": 10**6}}))
    assert main(["serve", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "in the configuration" not in err and len(err.splitlines()) == 1
    assert err.startswith("affinity-serve: error: invalid configuration: engine.max_model_len: ")


def test_ctrl_c_before_ray_is_one_line(monkeypatch, capsys):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr("affinity_serve.app.cli.check_model", interrupted)
    assert main(["serve", "--model", "/m"]) == 130
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == "[affinity-serve] interrupted; nothing was started."


def test_serve_run_does_not_log_that_it_reconnected_to_the_serve_just_started():
    from affinity_serve.app.cli import _NoReconnectNotice
    f = _NoReconnectNotice()
    record = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, 'Connecting to existing Serve app in '
                               'namespace "serve". New http_options/controller_options will not be applied.',
                               None, None)
    assert not f.filter(record)
    assert f.filter(logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "Deployed app", None, None))


# ---------------------------------------------------------------- 32.3: serve run app.builder:app_builder
def test_serve_run_of_the_builder_starts_serve_on_the_configs_port(tmp_path, monkeypatch):
    """`serve run` calls the builder before it starts Ray and Serve on port 8000: inside its click context,
    the builder starts them itself with serve run's own --address and runtime env, on the config's port."""
    import click
    from ray import serve
    from ray.serve.scripts import run as serve_run_command

    from affinity_serve.app import builder
    calls: list = []
    main_thread = threading.current_thread()
    # only the builder's calls: with ray.is_initialized patched, a background thread of an earlier test's Ray
    # client can auto-initialise meanwhile (make test once saw an extra ("init", {}))
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw))
                        if threading.current_thread() is main_thread else None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("start", kw)))
    monkeypatch.setattr(builder, "build_app", lambda cfg: "app")
    for var in ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "AFFINITY_SERVE_HTTP_LIMITS"):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"serve": {"port": 8123, "host": "127.0.0.1"}}))
    assert builder.app_builder({"config": str(cfg)}) == "app" and calls == []          # not under serve run
    params = {"config_or_import_path": "affinity_serve.app.builder:app_builder", "address": "127.0.0.1:6379",
              "runtime_env": None, "runtime_env_json": '{"env_vars": {"A": "1"}}', "working_dir": None}
    with click.Context(serve_run_command, info_name="run") as ctx:
        ctx.params.update(params)
        assert builder.app_builder({"config": str(cfg)}) == "app"
    assert calls == [("init", {"address": "127.0.0.1:6379", "namespace": "serve",
                               "runtime_env": {"env_vars": {"A": "1"}}}),
                     ("start", {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8123}})]
    import os
    assert os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "affinity_serve.app.http:proxy_middlewares"


def test_ready_message_says_how_drivers_and_rays_tools_attach(monkeypatch):
    from affinity_serve.app import cli
    from affinity_serve.app.config import AppConfig

    class Ctx:
        gcs_address = "127.0.0.1:41234"
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    monkeypatch.setattr(cli, "_dashboard_url", lambda: "http://127.0.0.1:8265")
    text = cli.ready_message(AppConfig(), cli.attach_message(AppConfig()))
    assert ("RAY_ADDRESS=127.0.0.1:41234 RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python ... "
            "(then ray.init(); "
            'serve.get_app_handle("affinity"))') in text
    assert "RAY_AUTH_MODE=token serve status --address http://127.0.0.1:8265" in text
    assert text.rstrip().endswith("Ctrl-C to stop.")


def test_deploy_checks_a_checkpoint_it_can_see_before_connecting(checkpoints, tmp_path, capsys):
    """`deploy` checks a checkpoint directory that is on this machine too (as `config` does) before it connects
    to the cluster: a broken one is one line and status 2, not a failure in every replica after the deploy."""
    import shutil
    d = tmp_path / "m"
    shutil.copytree(checkpoints["llama"], d)
    (d / "model.safetensors").unlink()
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": {"model": str(d)}}))
    assert main(["deploy", "--config", str(p)]) == 2           # the fixture fails the test if Ray starts
    err = capsys.readouterr().err
    assert err.startswith("affinity-serve: error: engine.model:") and "model.safetensors" in err
    p.write_text(json.dumps({"engine": {"model": "/only/on/the/replicas/nodes"}}))
    with pytest.raises(AssertionError, match="Ray was started"):
        main(["deploy", "--config", str(p)])
    assert "not a checkpoint directory on this machine" in capsys.readouterr().err
