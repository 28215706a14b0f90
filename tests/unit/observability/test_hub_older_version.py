"""The hub actor is detached and outlives redeploys: after an upgrade in place, processes of the new version may
meet a hub of the earlier one, whose push and render take no interval argument. They retry without it instead
of failing every push for the life of the process (a reviewer's finding)."""
from __future__ import annotations

import asyncio

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.app import metrics_hub


class _Method:
    def __init__(self, n_args: int, calls: list):
        self.n_args, self.calls = n_args, calls

    def remote(self, *args):
        if len(args) > self.n_args:          # what Ray's signature check raises for an older actor's method
            raise TypeError(f"too many positional arguments: {len(args)} > {self.n_args}")
        self.calls.append(args)
        return args


class _OldHub:
    def __init__(self):
        self.calls: list = []
        self.push = _Method(2, self.calls)
        self.render = _Method(4, self.calls)


def test_a_hub_of_an_earlier_version_gets_pushes_and_renders_without_the_interval(monkeypatch):
    import ray
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    hub = _OldHub()
    exp = metrics_hub.MetricsExporter(InMemoryMetricReader(), "app", "ingress:1", interval_s=3600.0)
    try:
        monkeypatch.setattr(exp, "_hub_handle", lambda create=False: hub)
        exp.push_once()
        exp.push_once()
        assert len(hub.calls) == 2 and all(len(c) == 2 for c in hub.calls) and not exp._hub_takes_interval

        async def fake_render(*args):
            return "text"
        hub.render.remote = lambda *args: (_ for _ in ()).throw(TypeError("too many positional arguments")) \
            if len(args) > 4 else fake_render(*args)
        exp._hub_takes_interval = True
        assert asyncio.run(exp.render("m")) == "text" and not exp._hub_takes_interval
    finally:
        exp.close()
