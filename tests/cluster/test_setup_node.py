"""deploy/setup-node.sh, the install step cluster.yaml's setup_commands run on every node (issue 32.6), run
here as it runs there (offline knobs only: tests/cluster/node_env.py); the `ray up` test runs it over SSH."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster.node_env import SCRIPT, copy_repository, offline_env, offline_venv

pytestmark = pytest.mark.slow


def test_setup_installs_the_repository_into_a_311_venv_first_on_path_idempotently(tmp_path):
    home = tmp_path / "home"
    copy_repository(home / "affinity-serve")
    (home / ".bashrc").write_text("case $- in *i*) ;; *) return;; esac\nalias ll='ls -l'\n")   # Ubuntu's opening
    venv = offline_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items()                    # a node's environment has none of these
           if not k.startswith(("AFFINITY_SERVE_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env |= offline_env(home, venv)
    for _ in range(2):                                   # every `ray up` runs it again
        r = subprocess.run(["bash", str(SCRIPT)], cwd=home, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "setup-node: affinity-serve with Ray 2.60.0" in r.stdout
    bashrc = (home / ".bashrc").read_text().splitlines()
    assert bashrc[0] == f'export PATH="{venv}/bin:$PATH"  # affinity-serve venv'
    assert sum("# affinity-serve venv" in line for line in bashrc) == 1
    out = subprocess.run(["bash", "-lc", "source ~/.bashrc; python -c 'import sys; from affinity_serve import app; "
                          "print(sys.version_info[:2] >= (3, 11), app.__path__[0])'; command -v affinity-serve"],
                         cwd=home, env=env,
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.split()
    assert lines[:2] == ["True", str(home / "affinity-serve" / "app")], out.stdout + out.stderr
    assert lines[2] == str(venv / "bin" / "affinity-serve")


def test_a_venv_older_than_311_is_replaced_and_a_failure_stops_the_setup(tmp_path):
    """An existing ~/venv of Python 3.10 does not count; with no uv and no network the script fails loudly
    (set -e), never goes on to start Ray on the wrong Python."""
    home = tmp_path / "home"
    home.mkdir()
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text("#!/bin/sh\nexit 1\n")       # 'not 3.11'
    (fake / "python").chmod(0o755)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "AFFINITY_SERVE_VENV": str(tmp_path / "venv"),
           "AFFINITY_SERVE_SRC": str(home / "affinity-serve")}
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("curl", "uv"):                              # the download and the venv creation both fail
        (tools / name).write_text("#!/bin/sh\necho no network >&2\nexit 7\n")
        (tools / name).chmod(0o755)
    env["PATH"] = f"{tools}:/usr/bin:/bin"
    r = subprocess.run(["bash", str(SCRIPT)], cwd=home, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no network" in r.stderr
    assert not (home / ".bashrc").exists() or "affinity-serve venv" not in (home / ".bashrc").read_text()
