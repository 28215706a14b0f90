"""Issue 32.2 and 32.3 through the real `affinity-serve serve`: another Python process (a Ray driver) gets
answers from the app's handle API, and Ray's own `serve status` attaches, each exactly as the ready message
says (the local Ray listens on 127.0.0.1 only and keeps Ray's token authentication on). And 32.1's start-up
half: Ctrl-C while it deploys is one line, no traceback."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from tests.integration.cli_process import CLI, ROOT

pytestmark = pytest.mark.slow

DRIVER = """
import json, ray
from ray import serve
ray.init(logging_level="WARNING")
h = serve.get_app_handle("affinity")
models = h.models.remote().result(timeout_s=60)
out = h.completions.remote({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                           "ignore_eos": True}).result(timeout_s=60)
print("RESULT", json.dumps({"models": models, "usage": out["usage"]}))
"""


@pytest.fixture
def served(cli_server):
    """The CLI server these tests share with test_cli_serve_hardening.py."""
    return cli_server.get()


def _printed_env(out: list[str], prefix: str) -> tuple[dict[str, str], list[str]]:
    """The environment assignments and the command of the ready message's line starting with `prefix`."""
    (line,) = [l for l in out if l.startswith(prefix)]
    words = shlex.split(line[len(prefix):].split(" (", 1)[0])
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    return env, [w for w in words if not re.match(r"^[A-Z_]+=", w)]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}


# first: it starts a CLI of its own, before the shared one starts
def test_ctrl_c_during_start_up_is_one_line(checkpoints, tmp_path):
    cli = CLI(checkpoints, tmp_path, {}, wait_ready=False)
    try:
        assert cli.wait_for("deploying 1 replica(s)", 120), "".join(cli.out)[-3000:]
        rc = cli.stop(signal.SIGINT, timeout_s=60)
    finally:
        if cli.proc.poll() is None:
            cli.stop(signal.SIGKILL)
    text = "".join(cli.out)
    assert rc == 130 and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert [l.strip() for l in cli.out if "interrupted" in l] == [
        "[affinity-serve] interrupted during start-up; stopped."], text[-3000:]


def test_a_second_driver_gets_answers_as_the_ready_message_says(served):
    env, _ = _printed_env(served.out, "[affinity-serve] other Ray drivers: ")
    assert set(env) == {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    r = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=_clean_env() | env, capture_output=True,
                       text=True, timeout=240)
    result = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and result, (r.stdout + r.stderr)[-3000:]
    import json
    got = json.loads(result[0][7:])
    assert got["models"]["data"][0]["id"] == "tiny" and got["usage"]["completion_tokens"] == 3


def test_serve_status_attaches_as_the_ready_message_says(served):
    env, cmd = _printed_env(served.out, "[affinity-serve] Ray's tools: ")
    assert cmd[:2] == ["serve", "status"] and env == {"RAY_AUTH_MODE": "token"}
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    r = subprocess.run([serve_cli, *cmd[1:]], cwd=ROOT, env=_clean_env() | env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "affinity:" in r.stdout and "status: RUNNING" in r.stdout and "LLMReplica:" in r.stdout, r.stdout
