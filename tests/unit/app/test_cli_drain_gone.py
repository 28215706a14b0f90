"""Ctrl-C after the app was deleted from elsewhere (serve.delete from a driver): the drain finds no Ingress
deployment and says so in one line; it raised a KeyError traceback from serve.get_deployment_handle."""
from __future__ import annotations

from affinity_serve.app import cli
from affinity_serve.app.config import AppConfig


def test_the_drain_of_an_app_deleted_meanwhile_is_one_line(monkeypatch, capsys):
    from ray import serve

    def gone(name, app_name):
        raise KeyError(f"Deployment(name='{name}', app='{app_name}') does not exist.")
    monkeypatch.setattr(serve, "get_deployment_handle", gone)
    cfg = AppConfig.model_validate({})
    assert cli.drain(cfg) == (0, 0)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"[affinity-serve] app {cfg.serve.app_name!r} is no longer deployed: nothing to drain; stopping"]
