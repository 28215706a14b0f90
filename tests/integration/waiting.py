"""Polling helper shared by the integration tests and the multi-node scenario script."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.1) -> Any:
    """Poll `cond` until it returns something truthy (returned); AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
