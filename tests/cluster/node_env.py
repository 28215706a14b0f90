"""A stand-in for a cloud node's home for deploy/setup-node.sh, offline: a copy of the repository where Ray's
file_mounts put it, and a Python 3.11 virtual environment that already sees this checkout's dependencies
(a .pth file), so the script's own steps run (venv found, PATH line, editable install, import check) without
downloading anything."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "setup-node.sh"


def copy_repository(dest: Path) -> Path:
    """What `rsync_filter: [.gitignore]` copies: the tracked files."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def offline_venv(path: Path) -> Path:
    """A venv of this interpreter's base Python whose site-packages also reads this checkout's environment."""
    # without its own pip and setuptools: the checkout's (newer, with bdist_wheel) come through the .pth
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(path)],
                   check=True)
    site = subprocess.run([str(path / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "checkout-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path


def offline_env(home: Path, venv: Path) -> dict[str, str]:
    """The script's environment knobs for an offline run (no extras, no index, no build isolation)."""
    return {"HOME": str(home), "AFFINITY_SERVE_VENV": str(venv), "AFFINITY_SERVE_SRC": str(home / "affinity-serve"),
            "AFFINITY_SERVE_EXTRAS": "", "AFFINITY_SERVE_PIP_ARGS": "--no-deps --no-build-isolation --no-index"}
