"""Fakes for app tests without Ray: deployment handles over plain objects, and log capture."""
from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest


class _Gen:
    """What `handle.options(stream=True).method.remote(...)` returns: async-iterable and cancellable."""

    def __init__(self, agen):
        self._agen = agen
        self.cancelled = False

    def __aiter__(self):
        return self._agen.__aiter__()

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, fn, calls: list):
        self._fn = fn
        self._calls = calls

    def remote(self, *args, **kwargs):
        self._calls.append((self._fn.__name__, args))
        out = self._fn(*args, **kwargs)
        return _Gen(out) if inspect.isasyncgen(out) else _awaitable(out)


async def _awaitable(out):
    return await out if inspect.isawaitable(out) else out


class LocalHandle:
    """A DeploymentHandle stand-in that calls methods of a local object (an LLMReplica or a fake)."""

    def __init__(self, target: Any):
        self._target = target
        self.calls: list[tuple[str, tuple]] = []

    def options(self, **_):
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self.calls)


@pytest.fixture
def app_logs(caplog):
    """caplog that also sees our JSON-configured loggers (they do not propagate to the root)."""
    loggers = [logging.getLogger(n) for n in ("affinity", "engine")]
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    yield caplog
    for lg, level, propagate, handlers in saved:
        lg.setLevel(level)
        lg.propagate = propagate
        lg.handlers[:] = handlers


@pytest.fixture(autouse=True)
def _restore_loggers():
    """Building an Ingress or a replica configures JSON logging on our loggers; undo it after each test."""
    loggers = [logging.getLogger(n) for n in ("affinity", "engine")]
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    yield
    for lg, level, propagate, handlers in saved:
        lg.setLevel(level)
        lg.propagate = propagate
        lg.handlers[:] = handlers
