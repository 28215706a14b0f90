"""The engine knows nothing of Ray, FastAPI or the app; the scheduler side never imports torch."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN_IN_ENGINE = {"ray", "fastapi", "starlette", "app", "autoscale", "observability"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_engine_imports_no_app_ray_or_fastapi():
    bad = {str(p.relative_to(ROOT)): _imports(p) & FORBIDDEN_IN_ENGINE
           for p in (ROOT / "engine").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_scheduler_and_hashing_import_without_torch():
    code = ("import sys; import engine.scheduler, engine.hashing, engine.kv_cache_manager; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
