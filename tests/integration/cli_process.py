"""`affinity-serve serve` as a subprocess for the CLI tests (test_cli_serve_hardening.py, test_cli_attach.py),
and one such server that several test modules share (the `cli_server` fixture of tests/integration/conftest.py):
a CLI start-up (its own Ray, Serve, one replica) takes ~20 s on 2 cores and its stop ~7 s."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-cli-9f8e7d6c5b4a39281706"


class CLI:
    """`affinity-serve serve` in a subprocess of its own session, its output collected line by line."""

    def __init__(self, checkpoints, tmp: Path, serve: dict, engine: dict | None = None, wait_ready: bool = True):
        ray_tmp = tempfile.mkdtemp(prefix="r33", dir="/tmp")        # short: Ray's socket paths must fit
        # What a forgotten `ray start --head` leaves: Ray's current-cluster record, pointing nowhere now.
        Path(ray_tmp, "ray").mkdir()
        Path(ray_tmp, "ray", "ray_current_cluster").write_text("127.0.0.1:1")
        cfg = tmp / "c.yaml"
        cfg.write_text(json.dumps({
            "engine": {"num_threads": 1, "cache": {"num_blocks": 128, "block_size": 4}, **(engine or {})},
            "serve": {"model_name": "tiny", "replica_num_cpus": 0.5, **serve}}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env |= {"AFFINITY_SERVE_API_KEY": KEY, "RAY_TMPDIR": ray_tmp, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "affinity_serve.app.cli", "serve", "--config", str(cfg),
                                      "--model",
                                      checkpoints["llama"], "--port", str(self.port), "--replicas", "1",
                                      "--dashboard-port", str(free_port())],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(l) for l in self.proc.stdout], daemon=True).start()
        self.out: list[str] = []
        if wait_ready:
            assert self.wait_for("Ctrl-C to stop", 240), "".join(self.out)[-4000:]

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(text in l for l in self.out):
            try:
                self.out.append(self._lines.get(timeout=0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self._lines.empty():
                    break
        return any(text in l for l in self.out)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.wait_for("\0never", 2)
            raise AssertionError(f"the CLI did not exit within {timeout_s} s of signal {sig}; its output:\n"
                                 + "".join(self.out)[-4000:]) from None
        self.wait_for("\0never", 2)                                   # the rest of the output
        return rc


#: the shared server's config: the HTTP limits test_cli_serve_hardening.py checks, and its long drain and paced
#: steps (40 ms: a 100-token stream lasts ~4 s) for the SIGINT drain test, the last to use it (it stops it)
SHARED_SERVE = {"body_read_timeout_s": 2, "max_header_bytes": 8192, "drain_timeout_s": 60}
SHARED_ENGINE = {"pace": {"enabled": True, "step_base_s": 0.04}}


class SharedCLI:
    """One CLI server for the tests that only talk to it: started on first use (again if it has exited), stopped
    by `stop` (tests/integration/conftest.py calls it as soon as the next test does not use it)."""

    def __init__(self, checkpoints, tmp: Path):
        self._checkpoints, self._tmp = checkpoints, tmp
        self._cli: CLI | None = None

    def get(self) -> CLI:
        if self._cli is None or self._cli.proc.poll() is not None:
            self.stop()
            self._cli = CLI(self._checkpoints, self._tmp, SHARED_SERVE, SHARED_ENGINE)
        return self._cli

    def stop(self) -> None:
        cli, self._cli = self._cli, None
        if cli is not None:
            cli.stop()
