"""`ray up` for real on this machine: Ray's `local` provider with 127.0.0.1 as the head, reached over SSH
through an sshd this test starts. The node gets what cluster.yaml gives it: its file_mounts (this repository,
rsync-filtered by .gitignore) and its setup_commands as written (deploy/setup-node.sh: a Python 3.11 venv
first on PATH, the repository installed into it; offline here: tests/cluster/node_env.py). Then the head's
start command deploys the app with that venv's `affinity-serve deploy`, a completion over HTTP, `ray down`.

Isolation: sshd runs as PID 1 of its own PID and /proc namespace (`unshare --pid --fork --mount-proc`), so
everything started over SSH lives in it, and the `ray stop` of the start commands and of `ray down` (which
kills every Ray process it can see) sees only this cluster's processes, not the pytest session's Ray or
anyone else's. The session's HOME is a temporary directory (sshd SetEnv), so ~/ray_bootstrap_*.yaml and
Ray's auth token land there, and `ray start --temp-dir` writes the cluster's address file in its own
temporary directory, so no `ray.init()` elsewhere on the machine finds it. So `make test` runs it in the main
suite, on the worker beside the Ray tests (marker `rayup`, to select it alone). Skipped, with the reason,
where sshd, ssh, rsync or unshare is missing or the namespace cannot be made."""
from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.node_env import offline_env, offline_venv
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.rayup]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent                 # this checkout's virtual environment
SSHD = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)


def _skip_reason() -> str | None:
    missing = [name for name, path in (("sshd", SSHD), ("ssh", shutil.which("ssh")),
                                       ("ssh-keygen", shutil.which("ssh-keygen")), ("rsync", shutil.which("rsync")),
                                       ("unshare", shutil.which("unshare"))) if not path]
    if missing:
        return (f"needs {', '.join(missing)} (Debian: apt-get install -y openssh-server rsync; .ci/run installs "
                "them when it can)")
    if not (BIN / "ray").exists() or not (BIN / "affinity-serve").exists():
        return f"needs ray and affinity-serve in {BIN} (make venv)"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot create a PID namespace (unshare --pid --mount-proc needs root or user namespaces): "
                f"without one `ray stop` would kill every Ray process on the machine ({probe.stderr.strip()})")
    if not os.path.isdir("/run/sshd"):
        if os.geteuid() != 0:
            return "sshd needs its privilege-separation directory /run/sshd (created at boot by the ssh service)"
        os.makedirs("/run/sshd", mode=0o755)      # what the ssh service creates at boot; nothing else changes
    return None


class LoopbackSSH:
    """A throwaway key pair and an sshd on a free 127.0.0.1 port, in its own PID namespace."""

    def __init__(self, root: Path, env: dict[str, str] | None = None):
        self.root, self.home, self.port = root, root / "home", free_port()
        self.home.mkdir(parents=True)
        self.key = root / "id_ed25519"
        for key in (self.key, root / "host_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        shutil.copy(f"{self.key}.pub", root / "authorized_keys")
        # ray's commands run in login shells that then source ~/.bashrc: the login profile puts this checkout's
        # environment on PATH (for `ray`; a real node's image has it too) and exports `env`; ~/.bashrc opens as
        # Ubuntu's does, and the setup script puts its venv in front of it
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        (self.home / ".bash_profile").write_text(f'export PATH="{BIN}:$PATH"\n{exports}')
        (self.home / ".bashrc").write_text("case $- in *i*) ;; *) return;; esac\n")
        (root / "sshd_config").write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {root}/host_ed25519",
            f"PidFile {root}/sshd.pid", f"AuthorizedKeysFile {root}/authorized_keys",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", f"AllowUsers {getpass.getuser()}", "UsePAM no", "StrictModes no",
            f"SetEnv HOME={self.home}", ""]))
        self.log = open(root / "sshd.log", "w")
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", SSHD, "-D",
                                      "-e", "-f", str(root / "sshd_config")],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "Server listening" in (root / "sshd.log").read_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"sshd did not start: {(root / 'sshd.log').read_text()[-2000:]}")

    @property
    def proxy_command(self) -> str:
        return f"{sys.executable} {ROOT / 'tests' / 'cluster' / 'tcp_relay.py'} 127.0.0.1 {self.port}"

    def close(self) -> None:
        """SIGKILL to the namespace's PID 1 (sshd) takes every process started over SSH with it."""
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in children:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


def _cluster_config(ssh: LoopbackSSH, name: str, app_yaml: Path, gcs_port: int, ray_tmp: str) -> dict:
    """The local cluster: cluster.yaml's file_mounts (its paths relative to the repository), rsync filter and
    setup_commands as they are; a loopback head, Ray's token auth and the test's app config instead of the
    cloud's start commands. The deploy runs from the home directory with the venv the setup made (a check
    first: `app` is the copy the file mounts put in ~/affinity-serve)."""
    real = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    mounts = {remote: str((ROOT / local).resolve()) for remote, local in real["file_mounts"].items()}
    mounts["~/affinity-serve.yaml"] = str(app_yaml)
    ray_start = (f"ray start --head --port={gcs_port} --node-ip-address=127.0.0.1 --num-cpus=2 "
                 f"--include-dashboard=false --disable-usage-stats --temp-dir={ray_tmp} "
                 "--autoscaling-config=~/ray_bootstrap_config.yaml")
    check = ("python -c \"import os, sys; from affinity_serve import app; assert sys.version_info >= (3, 11); "
             "assert app.__path__[0] == os.path.expanduser('~/affinity-serve/app'), app.__path__\"")
    return {
        "cluster_name": name,
        "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
        "auth": {"ssh_user": getpass.getuser(), "ssh_private_key": str(ssh.key),
                 "ssh_proxy_command": ssh.proxy_command},     # the launcher has no SSH port option
        "max_workers": 0,
        "file_mounts": mounts,
        "rsync_filter": real["rsync_filter"],
        "setup_commands": real["setup_commands"],
        "head_start_ray_commands": [
            "ray stop",                              # inside the namespace: nothing else to stop
            "ray get-auth-token --generate > /dev/null",    # Ray's token auth, token in the session's ~/.ray
            f"RAY_AUTH_MODE=token {ray_start}",
            f"cd ~ && {check} && RAY_AUTH_MODE=token affinity-serve deploy --config ~/affinity-serve.yaml "
            f"--address 127.0.0.1:{gcs_port}",
        ],
        "worker_start_ray_commands": [],
    }


def _ray(*args: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run([str(BIN / "ray"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    print(f"$ ray {' '.join(args)}  (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _processes_under(path: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", path], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if "pgrep" not in line]


def test_ray_up_deploys_the_app_serves_a_completion_and_ray_down_stops_it(tmp_path, checkpoints):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    ray_tmp = tempfile.mkdtemp(prefix="rayup-", dir="/tmp")   # short: Ray's socket paths must stay < 108 chars
    name = f"affinity-rayup-{uuid.uuid4().hex[:8]}"
    http_port, gcs_port = free_port(), free_port()
    app_yaml = tmp_path / "app.yaml"
    app_yaml.write_text(yaml.safe_dump({
        "engine": {"model": checkpoints["llama"], "num_threads": 1, "cache": {"num_blocks": 128, "block_size": 4}},
        "serve": {"host": "127.0.0.1", "port": http_port, "num_replicas": 1, "replica_num_cpus": 0.5,
                  "model_name": "tiny", "graceful_shutdown_timeout_s": 2.0},
        "observability": {"traces": "none"}}))
    venv = offline_venv(tmp_path / "venv")             # the node's ~/venv, made offline (node_env.py)
    knobs = {k: v for k, v in offline_env(tmp_path / "ssh" / "home", venv).items() if k != "HOME"}
    ssh = LoopbackSSH(tmp_path / "ssh", env=knobs)
    cluster_yaml = tmp_path / "local-cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(_cluster_config(ssh, name, app_yaml, gcs_port, ray_tmp)))
    # A stand-in for the pytest session's Ray outside the namespace: `ray stop` kills processes named raylet
    sentinel_exe = tmp_path / "raylet"
    sentinel_exe.symlink_to(shutil.which("sleep"))
    sentinel = subprocess.Popen([str(sentinel_exe), "600"])
    down_done = False
    try:
        start = time.monotonic()
        up = _ray("up", "-y", "--no-config-cache", "--disable-usage-stats", str(cluster_yaml),
                  cwd=tmp_path, timeout_s=300)
        assert up.returncode == 0, "ray up failed (output above)"
        up_s = time.monotonic() - start
        assert "deployed affinity at http://127.0.0.1" in up.stdout + up.stderr
        assert _processes_under(ray_tmp), "no Ray process of the launched cluster is running"

        with httpx.Client(timeout=60) as c:
            r = c.post(f"http://127.0.0.1:{http_port}/v1/completions",
                       json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"

        start_down = time.monotonic()
        down = _ray("down", "-y", str(cluster_yaml), cwd=tmp_path, timeout_s=120)
        down_done = True
        assert down.returncode == 0, "ray down failed (output above)"
        deadline = time.monotonic() + 30
        while _processes_under(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _processes_under(ray_tmp), "ray down left the cluster's Ray processes running"
        assert sentinel.poll() is None, "ray down's `ray stop` reached a Ray process outside its namespace"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5)
        print(json.dumps({"ray_up_s": round(up_s, 1), "ray_down_s": round(time.monotonic() - start_down, 1)}))
    finally:
        if not down_done:
            _ray("down", "-y", str(cluster_yaml), cwd=tmp_path, timeout_s=120)
        ssh.close()                       # and whatever the namespace still holds
        sentinel.kill()
        for suffix in ("state", "lock"):
            Path(tempfile.gettempdir(), "ray", f"cluster-{name}.{suffix}").unlink(missing_ok=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
