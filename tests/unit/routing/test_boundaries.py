"""The routing core imports nothing from Ray (only the Serve shell, serve_router.py and serve_compat.py, may), and the
load-only baselines."""
from __future__ import annotations

import ast
import pathlib
import random
import subprocess
import sys

import pytest

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, PowerOfTwoCore, Reason, ReplicaInfo,
                                        ReplicaLoadView, RoundRobinCore, RouteRequest, make_core)
from affinity_serve.app.routing import PrefixAffinityRouterCore

ROOT = pathlib.Path(__file__).resolve().parents[3]
SHELL = {"serve_router.py", "serve_compat.py"}


def _top_imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_the_core_imports_no_ray():
    files = [p for p in (ROOT / "app" / "routing").glob("*.py") if p.name not in SHELL]
    assert files
    bad = {p.name: _top_imports(p) & {"ray", "fastapi", "starlette", "torch"} for p in files}
    assert not {k: v for k, v in bad.items() if v}


def test_importing_the_core_loads_no_ray():
    code = "import sys, app.routing; assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _ids(core, n, **kw):
    return [core.route(RouteRequest(f"r{i}", [], 10, **kw), ["a", "b", "c"]).chosen for i in range(n)]


def test_round_robin_takes_candidates_in_turn():
    core = RoundRobinCore(AffinityConfig())
    assert _ids(core, 5) == ["a", "b", "c", "a", "b"]
    d = core.recent_decisions(1)[0]
    assert d.reason == Reason.LOAD and d.ranked == ["b", "c", "a"]


def test_power_of_two_prefers_the_less_loaded_of_its_pair():
    core = PowerOfTwoCore(AffinityConfig(), rng=random.Random(1))
    core.set_replicas([ReplicaInfo(r) for r in "abc"])
    core.on_stats("b", ReplicaLoadView(num_queued_prefill_tokens=10_000))
    picks = _ids(core, 60)
    assert "b" not in picks and set(picks) == {"a", "c"}


def test_baselines_follow_the_core_protocol():
    for name in ("round_robin", "power_of_two", "prefix_affinity"):
        core = make_core(name, AffinityConfig(), block_size=16)
        core.set_replicas([ReplicaInfo("a")])
        assert core.on_kv_events(KVEventBatch("a", "e", 0, []))
        d = core.route(RouteRequest("r", [b"x" * 32], 20, 5), ["a"])
        core.on_routed("r", "a")
        core.on_first_token("r", num_cached_tokens=0)
        core.on_finished("r")
        assert d.chosen == "a" and core.counters().num_decisions == 1
        assert core.route(RouteRequest("r2", [], 1), []).reason == Reason.FALLBACK
    assert isinstance(make_core("prefix_affinity", AffinityConfig(), 16), PrefixAffinityRouterCore)
    with pytest.raises(ValueError):
        make_core("random", AffinityConfig(), 16)   # type: ignore[arg-type]
