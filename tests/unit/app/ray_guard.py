"""A guard for CLI tests that must stop before Ray starts: `ray.init` raises RayStarted (so a test that expects
exit 2 fails if the CLI got that far, and one that expects the checks to pass sees the next step begin)."""
import pytest
import ray


class RayStarted(Exception):
    """`ray.init` was called: the CLI got past its pre-Ray checks."""


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*a, **kw):
        raise RayStarted
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)      # serve_cmd sets it; keep it out of other tests
