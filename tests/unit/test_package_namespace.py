"""The project's folders install under one namespace, `affinity_serve.*` (issue 32, finding 8): a user's own
`app.py`, `engine/` or `observability.py` in the working directory must not shadow ours, and no code of ours
imports the bare folder names (which would load a second copy of a module, or the user's file)."""
import ast
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("app", "engine", "autoscale", "observability")
CODE = ("app", "engine", "autoscale", "observability", "tests", "benchmarks", "tools")


def test_no_code_imports_the_bare_folder_names():
    bad = []
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bad, f"import these through affinity_serve.*: {bad}"


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"affinity_serve." + str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
               for top in FOLDERS for p in (ROOT / top).rglob("__init__.py")}
    assert set(cfg["packages"]) == folders
    assert cfg["package-dir"] == {f"affinity_serve.{t}": t for t in FOLDERS}


def test_a_users_app_py_and_engine_folder_do_not_shadow_ours(tmp_path):
    (tmp_path / "app.py").write_text("raise SystemExit('the user app.py was imported')\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("raise SystemExit('the user engine/ was imported')\n")
    (tmp_path / "observability.py").write_text("raise SystemExit('the user observability.py was imported')\n")
    code = ("from affinity_serve.app.errors import APIError; "
            "from affinity_serve.app.protocol import CompletionRequest; "
            "from affinity_serve.engine import SamplingParams; import affinity_serve.app.cli; "
            "import affinity_serve.observability; print(APIError.__module__, SamplingParams.__module__)")
    # `python -c` puts the working directory first on sys.path, as a user's script folder would be
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["affinity_serve.app.errors", "affinity_serve.engine.sampling_params"]
