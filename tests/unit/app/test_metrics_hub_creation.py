"""Who may create an app's metrics hub (app/metrics_hub.py): the app's own processes, at their first connection;
never Serve's controller, whose autoscaling-decision pushes go on for a few seconds after the app is deleted and
must not bring back a hub killed since. Ray's actor lookup and creation are stood in for: no Ray started."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import ray
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.app import metrics_hub
from affinity_serve.app.metrics_hub import MetricsExporter
from affinity_serve.autoscale.serve_policy import DecisionMetrics


class FakeRay:
    """The named hub actors that exist (by name), and the hubs created, with their options."""

    def __init__(self) -> None:
        self.actors: dict[str, object] = {}
        self.created: list[dict] = []

    def get_actor(self, name: str, namespace: str | None = None) -> object:
        assert namespace == metrics_hub.HUB_NAMESPACE
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return self.actors[name]

    def actor_class(self) -> object:
        def options(**opts):
            def remote():
                self.created.append(opts)
                return self.actors.setdefault(opts["name"], SimpleNamespace(name=opts["name"]))
            return SimpleNamespace(remote=remote)
        return SimpleNamespace(options=options)


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(ray, "get_actor", fake.get_actor)
    monkeypatch.setattr(metrics_hub, "_hub_actor_class", fake.actor_class)
    return fake


def _stop(exporter: MetricsExporter) -> None:
    exporter.close()
    if exporter._thread is not None:
        exporter._thread.join(timeout=30)


def test_the_controller_push_for_an_app_without_a_hub_creates_none(fake_ray, caplog):
    """The app deleted and its hub killed: the policy's exporter, still active for a few seconds, pushes nothing
    and creates nothing, quietly (as at the app's start, before its processes made the hub)."""
    dm = DecisionMetrics("deleted-app", "LLMReplica", push=True)
    try:
        with caplog.at_level(logging.WARNING, logger="affinity.metrics"):
            for _ in range(3):
                dm.exporter.push_once()
        assert fake_ray.created == []
        assert "metrics:deleted-app" not in fake_ray.actors
        assert not [r for r in caplog.records if r.name == "affinity.metrics"]
        # once the app's processes made it, the controller finds it and pushes there
        hub = fake_ray.actors["metrics:deleted-app"] = SimpleNamespace(name="metrics:deleted-app")
        assert dm.exporter._hub_handle() is hub and fake_ray.created == []
    finally:
        _stop(dm.exporter)


def test_a_process_of_the_app_creates_the_hub_at_its_first_connection_only(fake_ray):
    ex = MetricsExporter(InMemoryMetricReader(), "app", "ingress:x", interval_s=3600.0)
    try:
        hub = ex._hub_handle()
        assert [(o["name"], o["lifetime"], o["get_if_exists"]) for o in fake_ray.created] == \
            [("metrics:app", "detached", True)]
        assert ex._hub_handle() is hub
        # the hub killed (after `serve delete`, while this replica shuts down): looked up, not created again
        del fake_ray.actors["metrics:app"]
        ex._forget_hub(RuntimeError("actor died"))
        assert ex._hub_handle() is None
        ex.push_once()
        assert len(fake_ray.created) == 1 and "metrics:app" not in fake_ray.actors
        # a new process of the app (a redeploy) makes it again; this one finds it
        again = MetricsExporter(InMemoryMetricReader(), "app", "replica:y", interval_s=3600.0)
        try:
            new_hub = again._hub_handle()
        finally:
            _stop(again)
        assert len(fake_ray.created) == 2 and ex._hub_handle() is new_hub
    finally:
        _stop(ex)


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)
        return call()


class _Hub:
    """A hub actor that renders the processes' pushed counts, or fails as a dead actor does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = False
        self.render = _Remote(self._render)

    def _render(self, process, snapshot, model_name, vllm_aliases=True, interval_s=None):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return f"hub {self.name} for {process}"


async def test_metrics_never_fall_back_to_one_process_and_a_killed_hub_is_made_again_by_a_scrape(fake_ray,
                                                                                                  monkeypatch):
    """One process's counters in place of the app's read to Prometheus as a reset of every counter: while the
    hub cannot be asked the scrape fails (MetricsUnavailable -> 503); an app process answering the next scrape
    makes the killed hub again (the app is live: it is serving)."""
    def actor_class():
        def options(**opts):
            def remote():
                fake_ray.created.append(opts)
                return fake_ray.actors.setdefault(opts["name"], _Hub(opts["name"]))
            return SimpleNamespace(remote=remote)
        return SimpleNamespace(options=options)
    monkeypatch.setattr(metrics_hub, "_hub_actor_class", actor_class)
    ex = MetricsExporter(InMemoryMetricReader(), "app", "ingress:x", interval_s=3600.0)
    try:
        assert (await ex.render("tiny")).startswith("hub metrics:app for ingress:x")
        fake_ray.actors["metrics:app"].dead = True            # killed while the app runs
        del fake_ray.actors["metrics:app"]
        with pytest.raises(metrics_hub.MetricsUnavailable, match="unreachable"):
            await ex.render("tiny")
        assert len(fake_ray.created) == 1
        assert (await ex.render("tiny")).startswith("hub metrics:app")       # the next scrape: made again
        assert len(fake_ray.created) == 2
    finally:
        _stop(ex)
    # a pusher from outside the app never creates it: no hub, no numbers
    del fake_ray.actors["metrics:app"]
    outside = MetricsExporter(InMemoryMetricReader(), "app", "controller", interval_s=3600.0, creates_hub=False)
    try:
        with pytest.raises(metrics_hub.MetricsUnavailable, match="does not exist"):
            await outside.render("tiny")
        assert len(fake_ray.created) == 2
    finally:
        _stop(outside)


async def test_a_hub_that_does_not_answer_fails_the_scrape_instead_of_hanging_it(fake_ray, monkeypatch):
    class Stuck(_Hub):
        def __init__(self, name):
            super().__init__(name)

            class Never:
                def remote(self, *args):
                    return asyncio.get_running_loop().create_future()       # never resolved
            self.render = Never()
    fake_ray.actors["metrics:app"] = Stuck("metrics:app")
    monkeypatch.setattr(metrics_hub, "RENDER_TIMEOUT_S", 0.05)
    ex = MetricsExporter(InMemoryMetricReader(), "app", "ingress:x", interval_s=3600.0, creates_hub=False)
    try:
        with pytest.raises(metrics_hub.MetricsUnavailable, match="unreachable"):
            await asyncio.wait_for(ex.render("tiny"), 10)
    finally:
        _stop(ex)


async def test_a_warming_hub_fails_the_scrape_and_an_outage_is_warned_once_and_its_end_said(fake_ray, caplog):
    class Warming(_Hub):
        def _render(self, *args):
            return None if self.warming else super()._render(*args)
    hub = fake_ray.actors["metrics:app"] = Warming("metrics:app")
    hub.warming = True
    ex = MetricsExporter(InMemoryMetricReader(), "app", "ingress:x", interval_s=3600.0, creates_hub=False)
    try:
        with caplog.at_level(logging.INFO, logger="affinity.metrics"):
            with pytest.raises(metrics_hub.MetricsUnavailable, match="not every process has pushed"):
                await ex.render("tiny")
            hub.warming = False
            for _ in range(2):                                  # an outage, then the hub back: twice
                hub.dead = True
                for _ in range(3):
                    with pytest.raises(metrics_hub.MetricsUnavailable):
                        await ex.render("tiny")
                hub.dead = False
                assert (await ex.render("tiny")).startswith("hub metrics:app")
        said = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records if r.name == "affinity.metrics"]
        assert said == [("WARNING", "metrics hub of app app unreachable"),
                        ("INFO", "metrics hub of app app answers again")] * 2, said
    finally:
        _stop(ex)
