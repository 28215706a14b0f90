"""Issue 32.4 (and 32.1's start-up half): configuration errors that used to arrive as tracebacks are one line
before Ray starts, with exit status 2; the messages read as sentences; Ctrl-C before Ray is one line."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import ray

from app.cli import main


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
    monkeypatch.setattr("app.cli.check_model", interrupted)
    assert main(["serve", "--model", "/m"]) == 130
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == "[affinity-serve] interrupted; nothing was started."


def test_serve_run_does_not_log_that_it_reconnected_to_the_serve_just_started():
    from app.cli import _NoReconnectNotice
    f = _NoReconnectNotice()
    record = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, 'Connecting to existing Serve app in '
                               'namespace "serve". New http_options/controller_options will not be applied.',
                               None, None)
    assert not f.filter(record)
    assert f.filter(logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "Deployed app", None, None))
