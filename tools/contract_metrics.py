"""The request contract's numbers (issue 30): function lengths, request shapes on the path, limits checks.

    .venv/bin/python tools/contract_metrics.py [--tree DIR] [--json OUT]

`--tree DIR` measures another checkout of this repository (an older commit's `git worktree`): its folders
are imported as `affinity_serve.*` in place of the installed ones. Prints:

(a) lines per function (`def` line to last line, ast) over app/ engine/ autoscale/ observability/:
    count, median, p90.
(b) request shapes, counted by running requests through the in-process ingress (`Ingress` over one real
    `LLMReplica` on a tiny random model, no Ray): every object of a class of ours built while a request
    runs is recorded (a profiler hook on `__init__`, and pydantic's `model_validate`). In-path shapes are
    the classes, built before the request's first model step, of which some instance holds the prompt's
    token ids (a field equal to them, or a list field holding them); out-path shapes are the classes, built
    after it, of which some instance holds a field named `*token*` with output token ids. The JSON body in
    and the response dict out are counted as one shape each.
(c) limits checks per request: calls of the limits check (`EngineLimits.check`, and the module functions
    `check_request` / `check_request_fits_context` where a tree has them; a check calling another counts
    once), for one n=1 and one n=2 request, and how many of them scan the prompt against the vocabulary.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

PACKAGES = ("app", "engine", "autoscale", "observability")
PROMPT = [301, 415, 293, 606, 285, 114, 77, 508]


# ---------------------------------------------------------------- (a) function lengths
def function_lengths(root: Path) -> list[int]:
    lengths = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lengths.append(node.end_lineno - node.lineno + 1)
    return lengths


def length_summary(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)
    return {"functions": len(ordered), "median": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


# ---------------------------------------------------------------- import the tree to measure
def use_tree(tree: Path) -> None:
    """Make `affinity_serve.<pkg>` import from `tree/<pkg>` (a regular package ahead of the installed one)."""
    shim = Path(tempfile.mkdtemp(prefix="contract_metrics_")) / "affinity_serve"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    for pkg in PACKAGES:
        os.symlink(tree / pkg, shim / pkg)
    sys.path.insert(0, str(shim.parent))
    sys.path.insert(1, str(tree))


# ---------------------------------------------------------------- (c) counting limits checks
class CheckCounter:
    """Wraps every limits-check entry point; nested calls (one check calling another) count once."""

    def __init__(self) -> None:
        self.calls = 0
        self.vocab_scans = 0
        self._depth = 0

    def wrap(self, fn):
        counter = self

        def counted(*args, **kwargs):
            if counter._depth == 0:
                counter.calls += 1
                if _scans_vocabulary(args):
                    counter.vocab_scans += 1
            counter._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1
        counted.__wrapped__ = fn
        return counted

    def install(self) -> None:
        import affinity_serve.engine.limits as limits_mod
        if hasattr(limits_mod.EngineLimits, "check"):
            limits_mod.EngineLimits.check = self.wrap(limits_mod.EngineLimits.check)
        for name in ("check_request", "check_request_fits_context"):
            original = getattr(limits_mod, name, None)
            if original is None:
                continue
            wrapped = self.wrap(original)
            for mod in list(sys.modules.values()):        # every module that imported the function by name
                if getattr(mod, "__name__", "").startswith("affinity_serve") and getattr(mod, name, None) is original:
                    setattr(mod, name, wrapped)


def _scans_vocabulary(args: tuple) -> bool:
    from affinity_serve.engine.limits import EngineLimits
    limits = next((a for a in args if isinstance(a, EngineLimits)), None)
    prompt = next((a for a in args if isinstance(a, (list, tuple))), None)
    return limits is not None and limits.vocab_size is not None and prompt is not None


# ---------------------------------------------------------------- (b) recording shapes
class ShapeRecorder:
    """Every object of an affinity_serve class built while recording, split at the first model step."""

    def __init__(self) -> None:
        self.before: list[Any] = []
        self.after: list[Any] = []
        self.stepped = False
        self.recording = False

    def install(self) -> None:
        """Profile this thread and every thread started from now on (the engine's step thread and the
        ingress's prepare threads start later): call before anything is built."""
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def _profile(self, frame, event, _arg):
        if event != "call" or not self.recording:
            return
        code = frame.f_code
        if code.co_name == "execute_model":
            self.stepped = True
            return
        if code.co_name == "__init__":
            obj = frame.f_locals.get("self", frame.f_locals.get("__dataclass_self__"))
            if obj is not None and type(obj).__module__.startswith("affinity_serve"):
                (self.after if self.stepped else self.before).append(obj)

    def __enter__(self):
        from pydantic import BaseModel
        recorder = self
        self._validate = BaseModel.__dict__["model_validate"]

        def model_validate(cls, obj, *a, **kw):
            out = recorder._validate.__func__(cls, obj, *a, **kw)
            if cls.__module__.startswith("affinity_serve"):
                (recorder.after if recorder.stepped else recorder.before).append(out)
            return out
        BaseModel.model_validate = classmethod(model_validate)
        self.recording = True
        return self

    def __exit__(self, *exc):
        from pydantic import BaseModel
        self.recording = False
        BaseModel.model_validate = self._validate

    def shapes(self, prompt: list[int], output: set[int]) -> tuple[list[str], list[str]]:
        def fields(obj):
            if hasattr(obj, "__dict__"):
                yield from vars(obj).items()
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        yield name, getattr(obj, name)

        def holds_prompt(obj):
            for _, v in fields(obj):
                if v == prompt or (isinstance(v, list) and any(x == prompt for x in v if isinstance(x, list))):
                    return True
            return False

        def holds_output(obj):
            for name, v in fields(obj):
                if "token" not in name or not isinstance(v, list) or not v:
                    continue
                flat = [t for x in v for t in (x if isinstance(x, list) else [x])]
                if flat and all(isinstance(t, int) and t in output for t in flat):
                    return True
            return False
        ins = ["dict (JSON body)"] + _unique(type(o).__name__ for o in self.before if holds_prompt(o))
        outs = _unique(type(o).__name__ for o in self.after if holds_output(o)) + ["dict (response body)"]
        return ins, outs


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- the in-process path
class _LocalMethod:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        import inspect
        out = self._fn(*args, **kwargs)
        if inspect.isasyncgen(out):
            return _LocalStream(out)

        async def value():
            return await out if inspect.isawaitable(out) else out
        return value()


class _LocalStream:
    def __init__(self, agen):
        self._agen = agen

    def __aiter__(self):
        return self._agen.__aiter__()

    def cancel(self):
        pass


class _LocalHandle:
    """A DeploymentHandle stand-in over a local LLMReplica."""

    def __init__(self, target):
        self._target = target

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return _LocalMethod(getattr(self._target, name))


def _build(model_dir: str):
    """(ingress, replica) over one replica of the tiny model; tolerant of the constructors' signatures."""
    from affinity_serve.app.config import AppConfig
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica

    engine = {"model": model_dir, "cache": {"num_blocks": 128, "block_size": 4}}
    cfg = AppConfig.model_validate({"engine": engine})
    try:
        replica = LLMReplica(engine)
    except Exception:
        replica = LLMReplica(cfg.engine, cfg.serve, cfg.observability)
    try:
        ingress = Ingress(_LocalHandle(replica), cfg.model_dump())
    except Exception:
        ingress = Ingress(_LocalHandle(replica), cfg)
    return ingress, replica


async def _measure_path(model_dir: str) -> dict[str, Any]:
    rec = ShapeRecorder()
    rec.install()
    ingress, replica = _build(model_dir)
    await ingress.completions({"prompt": PROMPT, "max_tokens": 2, "temperature": 0})    # warm-up (limits fetch)
    counter = CheckCounter()
    counter.install()
    out: dict[str, Any] = {}
    for n in (1, 2):
        counter.calls = counter.vocab_scans = 0
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0 if n == 1 else 1.0, "n": n, "seed": 1,
                "return_token_ids": True}
        if n == 1:
            with rec:
                resp = await ingress.completions(body)
            output = {t for c in resp["choices"] for t in c["token_ids"]}
            out["in_shapes"], out["out_shapes"] = rec.shapes(PROMPT, output)
        else:
            await ingress.completions(body)
        out[f"checks_n{n}"], out[f"vocab_scans_n{n}"] = counter.calls, counter.vocab_scans
    await replica.engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=None, help="checkout to measure (default: this one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    root = (args.tree or Path(__file__).resolve().parent.parent).resolve()
    if args.tree is not None:
        use_tree(root)
    import logging
    logging.disable(logging.WARNING)
    result: dict[str, Any] = {"tree": str(args.tree) if args.tree else "."}
    result["function_lengths"] = length_summary(function_lengths(root))
    from affinity_serve.engine.demo import write_demo_model
    with tempfile.TemporaryDirectory() as d:
        write_demo_model(Path(d) / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, max_position_embeddings=512, seed=1)
        result.update(asyncio.run(_measure_path(str(Path(d) / "tiny"))))
    fl = result["function_lengths"]
    print(f"(a) functions: {fl['functions']}  lines per function: median {fl['median']}  p90 {fl['p90']}")
    print(f"(b) in-path shapes ({len(result['in_shapes'])}): {' -> '.join(result['in_shapes'])}")
    print(f"    out-path shapes ({len(result['out_shapes'])}): {' -> '.join(result['out_shapes'])}")
    print(f"(c) limits checks per request: n=1 {result['checks_n1']} ({result['vocab_scans_n1']} vocabulary "
          f"scans), n=2 {result['checks_n2']} ({result['vocab_scans_n2']} vocabulary scans)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
