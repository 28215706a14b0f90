"""The README and the docs site (docs/, mkdocs.yml) stay true to the code: every YAML block parses and, where it is a
configuration, validates against AppConfig; every Python block compiles and its imports from this project exist;
bash blocks name make targets, CLI flags and scripts that exist; the README's links resolve; every config field
has the description the generated reference (tools/gen_config_ref.py) is made of. `mkdocs build --strict`
(make docs, make test) checks the site's own links and anchors."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import shlex

import pytest
import yaml
from pydantic import BaseModel

from affinity_serve.app.config import AppConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_PROJECT_PACKAGES = ("app", "engine", "autoscale", "observability")


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(page:line, code) of every fenced block in `lang`, indentation removed."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            if m.group("lang") != lang:
                continue
            indent = m.group("indent")
            body = "".join(line[len(indent):] if line.startswith(indent) else line
                           for line in m.group("body").splitlines(keepends=True))
            out.append((f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", body))
    return out


def _ids(blocks):
    return [where for where, _ in blocks]


YAML = _blocks("yaml")
PYTHON = _blocks("python")
BASH = _blocks("bash")


def test_the_pages_have_blocks_of_each_kind():
    assert len(YAML) >= 8 and len(PYTHON) >= 5 and len(BASH) >= 10
    assert any(w.startswith("README.md") for w, _ in YAML + PYTHON + BASH)


@pytest.mark.parametrize("where,code", YAML, ids=_ids(YAML))
def test_yaml_block_parses_and_configs_validate(where, code):
    data = yaml.safe_load(code)
    assert data is not None, f"{where}: empty YAML block"
    if isinstance(data, dict) and set(data) <= set(AppConfig.model_fields):
        AppConfig.from_dict(data, source=where)            # raises ConfigError naming the key


def test_cluster_page_shows_the_real_cluster_app_config():
    cluster = [yaml.safe_load(code) for where, code in YAML if where.startswith("docs/cluster.md")]
    assert yaml.safe_load((ROOT / "deploy" / "cluster-app.yaml").read_text()) in cluster


@pytest.mark.parametrize("where,code", PYTHON, ids=_ids(PYTHON))
def test_python_block_compiles_and_its_project_imports_exist(where, code):
    tree = ast.parse(compile(code, where, "exec", flags=ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PROJECT_PACKAGES:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _PROJECT_PACKAGES:
                    importlib.import_module(alias.name)


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_-]+):(?!=)", text, flags=re.M))


def _commands(code: str) -> list[list[str]]:
    """Each command line of a bash block as words (comments dropped, continuation lines joined)."""
    text = code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split("#", 1)[0].split()
        if words:
            out.append(words)
    return out


@pytest.mark.parametrize("where,code", BASH, ids=_ids(BASH))
def test_bash_block_names_targets_flags_and_scripts_that_exist(where, code):
    from affinity_serve.app.cli import _parser
    targets = _make_targets()
    for words in _commands(code):
        if words[0] == "make":
            named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            assert set(named) <= targets, f"{where}: no make target {sorted(set(named) - targets)}"
        elif words[0].endswith("affinity-serve"):
            _parser().parse_args(words[1:])                 # exits (SystemExit) on an unknown command or flag
        for w in words:
            if re.fullmatch(r"(benchmarks|tests|tools|app|engine)/[\w/.-]+\.(py|yaml)", w):
                assert (ROOT / w).exists(), f"{where}: {w} does not exist"
            elif w.endswith(".yaml") and w in ("cluster.yaml",):
                assert (ROOT / w).exists()
        for flag, module in zip(words, words[1:]):
            if flag == "-m" and module.startswith("benchmarks."):
                path = ROOT / module.replace(".", "/")
                assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), \
                    f"{where}: no benchmark module {module}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_every_config_field_has_a_description():
    missing = [key for key, field in _leaf_fields(AppConfig) if not (field.description or "").strip()]
    assert missing == [], "give these fields Field(description=...): the configuration reference is generated from them"


def test_generated_reference_documents_every_key_with_its_default():
    from tools.gen_config_ref import render
    page = render()
    block = re.search(r"^```yaml\n(.*?)^```", page, flags=re.S | re.M).group(1)
    assert yaml.safe_load(block) == AppConfig().model_dump(mode="json")
    for key, field in _leaf_fields(AppConfig):
        section, _, name = key.rpartition(".")
        assert f"## `{section}`" in page and f"| `{name}` |" in page, key
        assert " ".join(field.description.split()).replace("|", "\\|") in page, key


def test_mkdocs_nav_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", config, flags=re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    pages.add("configuration-reference.md")                # generated by the build's hook
    assert pages == nav


def test_mkdocs_build_strict(tmp_path):
    """No broken link or anchor in the site (make docs and make test run the same build)."""
    pytest.importorskip("material")
    import os
    import subprocess
    import sys
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
