"""benchmarks/ is a package of the checkout (issue 30.5): each benchmark runs as `python -m benchmarks.<name>`
from the repository root, imports the project as `affinity_serve.*` and its siblings as `benchmarks.*`, and
no file edits sys.path to find either."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "benchmarks").rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


ENTRY_POINTS = [_module(p) for p in FILES if _has_main(p)]


def test_the_benchmarks_are_found():
    # a guard against the lists above going empty and the tests below passing on nothing
    assert {"benchmarks.engine_throughput", "benchmarks.routing.simulator", "benchmarks.kv_connector",
            "benchmarks.gpu_decode_profile"} <= set(ENTRY_POINTS)
    assert all((p.parent / "__init__.py").exists() for p in FILES), "every benchmarks/ folder is a package"


def test_no_benchmark_edits_sys_path():
    bad = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"run benchmarks as python -m benchmarks.<name> instead of editing sys.path: {bad}"


def test_every_entry_point_imports_as_a_module_of_the_checkout_without_running():
    # A fresh interpreter in the repository root, as `python -m` runs them: importing runs no benchmark
    # (each keeps its work under `if __name__ == "__main__"`) and finds every sibling and project module.
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('imported')"
    r = subprocess.run([sys.executable, "-c", code, *ENTRY_POINTS], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_starts_with_python_m(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr[-2000:]
