"""Dependency direction: the engine knows nothing of Ray, FastAPI or the app; the scheduler side never
imports torch; observability never imports the app; and the app uses only the engine's public names.

The engine's public surface is (1) the names in `engine.__all__`, imported as `from affinity_serve.engine import X`,
and (2) the torch-free modules in `engine.PUBLIC_MODULES` (boundary types, errors, limits, sampling
parameters, configuration), imported as `from affinity_serve.engine.<module> import X`. Everything else in `engine/` is
internal and may change without notice; app/ code that needs more adds a public name first.
"""
import ast
import pathlib
import subprocess
import sys

from affinity_serve import engine
ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN_IN_ENGINE = {"ray", "fastapi", "starlette", "app", "autoscale", "observability"}


def _top(module: str) -> str:
    """The package a module belongs to: ours by their folder name (`affinity_serve.app.x` -> `app`)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "affinity_serve" and len(parts) > 1 else parts[0]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {_top(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(_top(node.module))
            if node.module == "affinity_serve":
                out |= {a.name for a in node.names}
    return out


def _engine_imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of the engine package in one file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("affinity_serve.engine")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("affinity_serve.engine"):
            out.append((node.module, [a.name for a in node.names]))
    return out


def test_engine_imports_no_app_ray_or_fastapi():
    bad = {str(p.relative_to(ROOT)): _imports(p) & FORBIDDEN_IN_ENGINE
           for p in (ROOT / "engine").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_observability_imports_no_app_or_ray():
    bad = {str(p.relative_to(ROOT)): _imports(p) & {"app", "ray", "fastapi"}
           for p in (ROOT / "observability").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_app_uses_only_the_engines_public_names():
    public_names, public_modules = set(engine.__all__), set(engine.PUBLIC_MODULES)
    bad = []
    for path in (ROOT / "app").rglob("*.py"):
        for module, names in _engine_imports(path):
            if module == "affinity_serve.engine":
                bad += [f"{path.name}: from affinity_serve.engine import {n}" for n in names if n not in public_names]
            elif module not in public_modules:
                bad.append(f"{path.name}: {module}")
    assert not bad, f"app/ reaches into engine internals (make them public first): {bad}"
    assert all(hasattr(engine, n) for n in public_names)
    for name in public_modules:
        __import__(name)


def test_scheduler_hashing_and_limits_import_without_torch():
    code = ("import sys; import affinity_serve.engine.scheduler, affinity_serve.engine.hashing, "
            "affinity_serve.engine.kv_cache_manager, affinity_serve.engine.limits; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_app_does_not_reach_through_the_async_engine_into_llm_engine():
    """The replicas use AsyncLLMEngine's public surface (load, kv_snapshot, block_size, ...), never its inner
    `LLMEngine` (`self.engine.engine...`)."""
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "app").rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1) if ".engine.engine." in line]
    assert not bad, bad
