"""A stand-in scenario for tests/unit/test_background_scenario.py: `python -m tests.unit.scenario_stub WORKDIR`
waits while WORKDIR/hold exists (up to 60 s), then at `wait_for_go` (WORKDIR/past_go marks it passed), then returns;
either way its `finally` writes WORKDIR/cleaned, as a real scenario's stops its cluster. Where WORKDIR/spawn exists it
first starts a child process (its pid in WORKDIR/child), as a real scenario starts Ray's, and stops it at the end."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.integration.subprocess_scenario import scenario_main, wait_for_go


def scenario(workdir: Path) -> dict:
    child = None
    try:
        if (workdir / "spawn").exists():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            (workdir / "child").write_text(str(child.pid))
        (workdir / "started").write_text("")
        deadline = time.monotonic() + 60
        while (workdir / "hold").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = wait_for_go(60)
        (workdir / "past_go").write_text("")
        return {"answer": 42, "timings_s": {"waited_for_go": waited}}
    finally:
        if child is not None:
            child.kill()
            child.wait()
        (workdir / "cleaned").write_text("")


if __name__ == "__main__":
    sys.exit(scenario_main(scenario, sys.argv[1:]))
