"""A stand-in scenario for tests/unit/test_background_scenario.py: `python -m tests.unit.scenario_stub WORKDIR`
returns at once unless WORKDIR/hold exists, in which case it waits (up to 60 s); either way its `finally` writes
WORKDIR/cleaned, as a real scenario's stops its cluster."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.integration.subprocess_scenario import scenario_main


def scenario(workdir: Path) -> dict:
    try:
        (workdir / "started").write_text("")
        deadline = time.monotonic() + 60
        while (workdir / "hold").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"answer": 42, "timings_s": {"total": 0.0}}
    finally:
        (workdir / "cleaned").write_text("")


if __name__ == "__main__":
    sys.exit(scenario_main(scenario, sys.argv[1:]))
