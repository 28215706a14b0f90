"""The engine's modules import each other without a cycle.

Counted: every module-level import of another engine module, those under `if TYPE_CHECKING:` included (a
cycle there is a cycle in what the modules mean, and it turns into an import error the day someone needs
the name at run time). Not counted: imports inside functions (the deliberate lazy ones: GPU-only code,
optional packages), and the implicit import of a package's `__init__` by its own submodules.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "affinity_serve." + ".".join(parts)


def _module_level_imports(body: list[ast.stmt]) -> list[str]:
    """Modules named by imports at module level, through if/try blocks (TYPE_CHECKING ones too)."""
    out: list[str] = []
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]        # `from pkg import submodule`
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.If):
            out += _module_level_imports(node.body) + _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            out += _module_level_imports(node.body) + _module_level_imports(node.orelse)
            for handler in node.handlers:
                out += _module_level_imports(handler.body)
    return out


def engine_import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ENGINE.rglob("*.py")}
    return {name: {m for m in _module_level_imports(ast.parse(path.read_text()).body)
                   if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            return cycle
    return None


def test_engine_modules_import_without_a_cycle():
    cycle = find_cycle(engine_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_type_checking_imports_and_finds_a_cycle():
    graph = engine_import_graph()
    # the step plan names the structured-output bitmask only for type checking: still an edge
    assert "affinity_serve.engine.structured_output.grammar" in graph["affinity_serve.engine.types"]
    assert "affinity_serve.engine.types" in graph["affinity_serve.engine.kv_connector.base"]
    looped = {**graph, "affinity_serve.engine.types": graph["affinity_serve.engine.types"]
              | {"affinity_serve.engine.kv_connector.base"}}
    cycle = find_cycle(looped)
    assert cycle is not None
    assert {"affinity_serve.engine.types", "affinity_serve.engine.kv_connector.base"} <= set(cycle)
