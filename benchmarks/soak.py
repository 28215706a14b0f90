"""Soak: replica (and ingress, proxy) memory over a long run of mixed traffic, leak or plateau.

Starts a local Ray + Serve on 127.0.0.1 the way `affinity-serve serve --replicas N` does (`app.cli.init_ray`:
loopback only, the HTTP limits; the default observability: in-memory traces, INFO logs), deploys
`app.builder.build_app` with the demo model, and drives mixed traffic from a bounded number of client tasks
over loopback: streamed chat and completions, streams the client drops after 1-3 chunks, n > 1,
logprobs (chat, completions, echo, prompt_logprobs), batched prompts, and bad inputs that must get a 4xx.
First `--warmup-s` of traffic (not measured), then `--minutes` of it (measured).

Every `--sample-s` it reads each process's RSS from /proc/<pid>/status (the pids from the GCS actor table:
the Serve replica actors of the app, the proxy) and asks each model replica for a probe (`soak_probe`: a method
this benchmark adds to a subclass of `LLMReplica`, nothing else changes): its glibc heap (`mallinfo2`: bytes
in use by live allocations vs. free but kept), the number of objects the collector tracks, and the length of
every container reachable from the engine (requests, streams, KV event log, signal windows, ...). At the
end, with the traffic stopped: zero leaked KV blocks (each replica's `num_free_blocks == num_blocks - 1`, no
requests held), object types whose counts grew since the warm-up, and RSS before and after `malloc_trim(0)`
(memory the allocator kept after it was freed comes back then; live objects do not).

The verdict per process compares the measured window's halves: a leak grows at a steady rate (second half's
growth per 1k requests about the first's: the request rate can change), a plateau's second-half slope is
near 0 (below `--flat-mb-per-min`). `--env` and `--linear-backend` change the replicas for an A/B run;
docs/benchmarks/soak.md has the latest figures and what they showed.

    python -m benchmarks.soak --minutes 8 --json soak.json --png soak.png
    python -m benchmarks.soak --from-json soak.json          # the table again, no run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


APP_NAME = "soak"
MODEL_NAME = "demo"
REQUEST_TIMEOUT_S = 60.0

#: request kinds and their weights in the mix
MIX = {"chat_stream": 0.18, "completion_stream": 0.12, "abort": 0.15, "n": 0.10, "logprobs": 0.15,
       "batch": 0.10, "bad": 0.20}

_WORDS = ("the quick brown fox jumps over the lazy dog serve cache block replica token prefix route model "
          "stream prompt engine scheduler paris france story journey thousand miles question gold power "
          "cluster machine users fair fast budget step runner sampler chooses unicode café naïve 東京 🙂").split()


@dataclass(frozen=True, slots=True)
class SoakSpec:
    minutes: float = 8.0                 # the measured soak, after the warm-up
    warmup_s: float = 60.0
    sample_s: float = 10.0
    replicas: int = 2
    clients: int = 6                     # client tasks, each one request at a time
    num_threads: int = 1                 # torch threads per replica
    seed: int = 0
    flat_mb_per_min: float = 1.0         # a second-half slope below this is a plateau
    probe: bool = True                   # deploy the probing LLMReplica subclass
    tracemalloc: bool = False            # trace the replicas' Python allocations from the warm-up's end (slow)
    env: tuple[tuple[str, str], ...] = ()  # environment for the local Ray's processes (replicas included)
    linear_backend: str = "auto"         # engine.linear_backend of the replicas


# ================================================================== analysis (pure)
def slope_per_min(ts_s: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per minute; 0 with fewer than 2 distinct times."""
    n = len(ts_s)
    if n < 2:
        return 0.0
    mt, my = sum(ts_s) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts_s)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts_s, ys)) / var


def verdict(slope_first: float, slope_second: float, flat: float, per_req_first: float | None = None,
            per_req_second: float | None = None) -> str:
    """plateau: the second half is flat (MB/min below `flat`); leak?: it still grows about as fast as in the
    first half; settling: it grows, but at less than half the first half's rate (a longer run decides).

    With the growth per request of each half (MB per 1k requests), the halves are compared on that: a
    per-request leak costs the same per request whatever the request rate, and the rate can change during
    a soak on a shared machine."""
    if slope_second < flat:
        return "plateau"
    first, second = slope_first, slope_second
    if per_req_first is not None and per_req_second is not None:
        first, second = per_req_first, per_req_second
    if second >= 0.5 * first:
        return "leak?"
    return "settling"


def analyze_series(ts_s: list[float], ys: list[float], t_start: float, flat: float,
                   requests: list[float] | None = None) -> dict[str, float | str]:
    """One process's RSS (MB) over the measured window (samples at t >= t_start): the first value, the last,
    the slope over all of it and over each half, per minute and (given the requests sent by each sample)
    per 1k requests, and the verdict."""
    reqs = requests if requests is not None else [0.0] * len(ts_s)
    pts = [(t, y, r) for t, y, r in zip(ts_s, ys, reqs) if t >= t_start]
    if len(pts) < 2:
        raise ValueError(f"need >= 2 samples after t={t_start}, got {len(pts)}")
    t0, t1 = pts[0][0], pts[-1][0]
    mid = (t0 + t1) / 2
    first = [p for p in pts if p[0] <= mid]
    second = [p for p in pts if p[0] >= mid]

    def per_min(ps: list[tuple]) -> float:
        return slope_per_min([p[0] for p in ps], [p[1] for p in ps])

    def per_1k(ps: list[tuple]) -> float | None:     # MB per 1k requests (slope_per_min's x is "seconds")
        if requests is None:
            return None
        return slope_per_min([p[2] for p in ps], [p[1] for p in ps]) / 60.0 * 1000.0
    s1, s2, r1, r2 = per_min(first), per_min(second), per_1k(first), per_1k(second)
    return {"start_mb": pts[0][1], "end_mb": pts[-1][1], "growth_mb": pts[-1][1] - pts[0][1],
            "max_mb": max(p[1] for p in pts), "minutes": (t1 - t0) / 60.0, "slope_mb_per_min": per_min(pts),
            "slope_first_half": s1, "slope_second_half": s2, "requests": pts[-1][2] - pts[0][2],
            "per_1k_requests_first_half": r1, "per_1k_requests_second_half": r2,
            "verdict": verdict(s1, s2, flat, r1, r2)}


def rss_table(rows: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per process (analyze_series's dict, plus optional 'trimmed_mb')."""
    head = ("| process | after warm-up MB | at end MB | growth MB | MB/min (all) | MB/min 1st half | "
            "MB/min 2nd half | MB/1k req 1st half | MB/1k req 2nd half | after malloc_trim MB | verdict |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    out = [head]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    for name, r in rows.items():
        out.append(f"| {name} | {r['start_mb']:.0f} | {r['end_mb']:.0f} | {r['growth_mb']:+.0f} | "
                   f"{r['slope_mb_per_min']:+.2f} | {r['slope_first_half']:+.2f} | {r['slope_second_half']:+.2f} | "
                   f"{num(r.get('per_1k_requests_first_half'), '+.1f')} | "
                   f"{num(r.get('per_1k_requests_second_half'), '+.1f')} | {num(r.get('trimmed_mb'), '.0f')} | "
                   f"{r['verdict']} |")
    return "\n".join(out)


def grown_containers(before: dict[str, int], after: dict[str, int], min_growth: int = 16) -> dict[str, tuple]:
    """Containers (path -> len) that grew by at least `min_growth` entries: (before, after)."""
    return {k: (before.get(k, 0), v) for k, v in sorted(after.items())
            if v - before.get(k, 0) >= min_growth}


def grown_types(before: dict[str, int], after: dict[str, int], top: int = 12) -> list[tuple[str, int, int]]:
    """The object types whose counts grew most: (type, before, after), largest growth first."""
    deltas = [(k, before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)]
    return sorted(deltas, key=lambda d: d[2] - d[1], reverse=True)[:top]


# ================================================================== process memory
def read_rss_mb(pid: int) -> float | None:
    """VmRSS of `pid` in MB (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _mallinfo2() -> dict[str, int]:
    """glibc's heap counters over all arenas (empty off glibc)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_in_use": m.uordblks + m.hblkhd, "heap_free_kept": m.fordblks, "mmapped": m.hblkhd,
            "arena": m.arena}


def container_sizes(root: Any, name: str = "replica", max_depth: int = 4) -> dict[str, int]:
    """len() of every dict / list / set / deque reachable through attributes of the project's own objects
    (modules engine., app., autoscale., observability.) from `root`, by attribute path."""
    from collections import deque
    out: dict[str, int] = {}
    seen: set[int] = set()
    ours = ("engine.", "app.", "autoscale.", "observability.", "benchmarks.", "__main__")

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        attrs: dict[str, Any] = {}
        if hasattr(obj, "__dict__"):
            attrs.update(vars(obj))
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
        for k, v in attrs.items():
            p = f"{path}.{k}"
            if isinstance(v, (dict, list, set, frozenset, deque)):
                out[p] = len(v)
            elif type(v).__module__.startswith(ours):
                walk(v, p, depth + 1)
    walk(root, name, 0)
    return out


def probe_process(root: Any, detail: bool = False, trim: bool = False, trace: str = "") -> dict[str, Any]:
    """This process's memory as the soak reads it (runs inside a replica). `trace`: "start" starts
    tracemalloc; "report" adds the Python allocations still alive since then, biggest first, by traceback."""
    import gc
    import tracemalloc
    if trace == "start" and not tracemalloc.is_tracing():
        tracemalloc.start(12)
    if trace == "report" and tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        stats = snap.statistics("traceback")
        report = {"traced_mb": sum(st.size for st in stats) / 2**20, "top": [
            {"size_mb": st.size / 2**20, "count": st.count,
             "frames": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in st.traceback][-8:]}
            for st in stats[:12]]}
    out: dict[str, Any] = {"pid": os.getpid(), "rss_mb": read_rss_mb(os.getpid()), "gc_objects": len(gc.get_objects()),
                           "malloc": _mallinfo2(), "containers": container_sizes(root)}
    if detail:
        counts: dict[str, int] = {}
        for o in gc.get_objects():
            t = type(o).__qualname__
            counts[t] = counts.get(t, 0) + 1
        out["types"] = counts
    if trim:
        import ctypes
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        out["rss_after_trim_mb"] = read_rss_mb(os.getpid())
        out["malloc_after_trim"] = _mallinfo2()
    if trace == "report" and tracemalloc.is_tracing():
        out["tracemalloc"] = report
    return out


def probe_replica_class():
    """LLMReplica plus `soak_probe` (defined here, shipped by value: nothing in app/ changes)."""
    from affinity_serve.app.replica import LLMReplica

    class SoakProbeReplica(LLMReplica):
        async def soak_probe(self, detail: bool = False, trim: bool = False, trace: str = "") -> dict[str, Any]:
            out = probe_process(self, detail, trim, trace)
            out["replica_id"] = self.replica_id
            return out
    return SoakProbeReplica


# ================================================================== cluster
def start(spec: SoakSpec) -> tuple[str, Any]:
    """Ray + Serve on 127.0.0.1 as `affinity-serve serve` starts them; deploys the app; returns (base URL, config)."""
    from affinity_serve.app.cli import init_ray, start_serve
    from affinity_serve.app.config import AppConfig
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = AppConfig.model_validate({
        "engine": {"num_threads": spec.num_threads, "linear_backend": spec.linear_backend},
        "serve": {"app_name": APP_NAME, "host": "127.0.0.1", "port": port, "num_replicas": spec.replicas,
                  "model_name": MODEL_NAME}})
    import affinity_serve.app.builder as builder
    cfg = builder.resolve_model(cfg)
    os.environ.update(dict(spec.env))        # the local Ray started below passes it on to every worker
    init_ray(None, cfg)
    start_serve(cfg)
    if spec.probe:
        builder.LLMReplica = probe_replica_class()      # this process only: build_app picks it up
    from ray import serve
    serve.run(builder.build_app(cfg), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}", cfg


def stop() -> None:
    import ray
    from ray import serve
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def find_pids(replicas: int, timeout_s: float = 60.0) -> dict[str, int]:
    """name -> pid: replica0.., ingress, proxy (the GCS actor table: the alive actors' classes and pids; Ray's
    state API would need the dashboard, which a loopback-only `serve` does not start)."""
    from ray._private import state
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
        reps = sorted(a["Pid"] for a in actors if a["ActorClassName"] == f"ServeReplica:{APP_NAME}:LLMReplica")
        ing = [a["Pid"] for a in actors if a["ActorClassName"] == f"ServeReplica:{APP_NAME}:Ingress"]
        proxy = [a["Pid"] for a in actors if a["ActorClassName"] == "ProxyActor"]
        if len(reps) == replicas and ing and proxy:
            out = {f"replica{i}": p for i, p in enumerate(reps)}
            return out | {"ingress": ing[0], "proxy": proxy[0]}
        if time.monotonic() > deadline:
            raise RuntimeError(f"found {len(reps)} replica actors, {len(ing)} ingress, {len(proxy)} proxy")
        time.sleep(1)


def _each_replica(method: str, replicas: int, *args: Any, max_calls: int = 200) -> dict[str, Any]:
    """Call `method` until every replica answered: replica_id -> result. A handle call lands on one replica
    (for a call without a prompt, the least loaded), so each round sends several at once, which the router
    spreads by load."""
    from ray import serve
    h = serve.get_deployment_handle("LLMReplica", APP_NAME)
    seen: dict[str, Any] = {}
    per_round = 3 * replicas
    for _ in range(max_calls // per_round):
        calls = [getattr(h, method).remote(*args) for _ in range(per_round)]
        for c in calls:
            r = c.result(timeout_s=60)
            seen.setdefault(r["replica_id"], r)
        if len(seen) == replicas:
            return seen
    raise RuntimeError(f"only {len(seen)} of {replicas} replicas answered {method}")


def probes(replicas: int, pids: dict[str, int], detail: bool = False, trim: bool = False,
           trace: str = "") -> dict[str, Any]:
    """Replica name (as in pids) -> its soak_probe."""
    by_pid = {p: n for n, p in pids.items()}
    got = _each_replica("soak_probe", replicas, detail, trim, trace)
    return {by_pid.get(r["pid"], r["replica_id"]): r for r in got.values()}


def kv_leak_check(replicas: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """With the traffic stopped: every replica holds no request and frees every block but the null one."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = _each_replica("debug_state", replicas)
        rows = {rid: {"num_free_blocks": s["num_free_blocks"], "num_blocks": s["num_blocks"],
                      "num_requests": s["num_requests"], "num_in_flight": s["num_in_flight"],
                      "leaked_blocks": s["num_blocks"] - 1 - s["num_free_blocks"]} for rid, s in states.items()}
        ok = all(r["leaked_blocks"] == 0 and r["num_requests"] == 0 and r["num_in_flight"] == 0
                 for r in rows.values())
        if ok or time.monotonic() > deadline:
            return {"ok": ok, "replicas": rows}
        time.sleep(1)


# ================================================================== traffic
@dataclass(slots=True)
class Counts:
    sent: int = 0
    ok: int = 0                  # 200 (streams complete, aborts dropped as planned)
    expected_4xx: int = 0        # bad inputs refused with a 4xx
    unexpected: int = 0          # anything else: 5xx, a 2xx for a bad input, an in-band error, a timeout
    by_kind: dict[str, int] | None = None
    errors: list[str] | None = None

    def note(self, kind: str, outcome: str, err: str = "") -> None:
        self.by_kind = self.by_kind or {}
        self.errors = self.errors if self.errors is not None else []
        self.sent += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if outcome == "ok":
            self.ok += 1
        elif outcome == "4xx":
            self.expected_4xx += 1
        else:
            self.unexpected += 1
            if len(self.errors) < 20:
                self.errors.append(f"{kind}: {err}"[:300])


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))) + f" #{rng.randrange(10**9)}"


def _system(rng: random.Random) -> str:
    """One of 8 shared system prompts (prefix-cache hits and the router's index)."""
    k = rng.randrange(8)
    return f"You are assistant number {k}. " + " ".join(_WORDS[(k * 7 + i) % len(_WORDS)] for i in range(60))


def _bad_bodies(rng: random.Random, vocab: int) -> list[tuple[str, Any]]:
    """(path, body or raw bytes) that must each get a 4xx."""
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        (c, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}),
        (c, {"model": "no-such-model", "prompt": "hi"}),
        (c, b'{"model": "demo", "prompt": '),
        (ch, {"model": MODEL_NAME, "messages": []}),
        (c, {"model": MODEL_NAME, "prompt": "hi", "temperature": "hot"}),
        (c, {"model": MODEL_NAME, "prompt": "hi", "top_k": 2 ** 64}),
        (c, {"model": MODEL_NAME, "prompt": [[vocab + 5, 7]]}),
        (c, {"model": MODEL_NAME, "prompt": _text(rng, 3000, 3000)}),          # longer than the context
        (c, {"model": MODEL_NAME, "prompt": "hi", "n": 0}),
        (ch, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4.5}),
        (ch, {"model": MODEL_NAME, "messages": [{"role": "user", "content": deep}]}),
        (c, {"model": MODEL_NAME, "prompt": "hi", "logprobs": 99}),
        (c, b'{"model": "demo", "prompt": "hi", "request_id": "\\ud800"}'),
        (c, {"model": MODEL_NAME, "prompt": ["a"] * 65}),
    ]


def build_request(kind: str, rng: random.Random, vocab: int) -> tuple[str, Any, bool, bool]:
    """(path, body, stream, expect_4xx) for one request of `kind`."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    if kind == "bad":
        path, body = rng.choice(_bad_bodies(rng, vocab))
        return path, body, False, True
    if kind in ("chat_stream", "abort") and rng.random() < 0.7:
        body = {"model": MODEL_NAME, "stream": True, "max_tokens": rng.randint(8, 32),
                "messages": [{"role": "system", "content": _system(rng)},
                             {"role": "user", "content": _text(rng, 5, 40)}],
                "stream_options": {"include_usage": True}}
        return ch, body, True, False
    if kind in ("completion_stream", "chat_stream", "abort"):
        prompt: Any = (_text(rng, 10, 80) if rng.random() < 0.6
                       else [rng.randrange(6, vocab) for _ in range(rng.randint(8, 200))])
        return c, {"model": MODEL_NAME, "prompt": prompt, "stream": True, "max_tokens": rng.randint(8, 32),
                   "ignore_eos": rng.random() < 0.5, "stream_options": {"include_usage": True}}, True, False
    if kind == "n":
        return c, {"model": MODEL_NAME, "prompt": _system(rng) + _text(rng, 5, 30), "n": rng.randint(2, 4),
                   "temperature": 0.9, "max_tokens": rng.randint(4, 24), "seed": rng.randrange(1000)}, False, False
    if kind == "logprobs":
        stream = rng.random() < 0.5
        if rng.random() < 0.5:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": _text(rng, 5, 40)}],
                    "logprobs": True, "top_logprobs": rng.randint(1, 5), "max_tokens": rng.randint(4, 24),
                    "stream": stream}
            return ch, body, stream, False
        body = {"model": MODEL_NAME, "prompt": _text(rng, 10, 60), "logprobs": rng.randint(1, 5),
                "echo": rng.random() < 0.3, "max_tokens": rng.randint(4, 24), "stream": stream}
        if not stream and rng.random() < 0.3:        # prompt_logprobs: not with stream (a 400)
            body["prompt_logprobs"] = rng.randint(1, 3)
        return c, body, stream, False
    if kind == "batch":
        k = rng.randint(2, 6)
        prompts: Any = ([_text(rng, 5, 40) for _ in range(k)] if rng.random() < 0.5 else
                        [[rng.randrange(6, vocab) for _ in range(rng.randint(8, 100))] for _ in range(k)])
        return c, {"model": MODEL_NAME, "prompt": prompts, "max_tokens": rng.randint(4, 16)}, False, False
    raise ValueError(kind)


async def one_request(client: Any, url: str, kind: str, rng: random.Random, vocab: int) -> tuple[str, str]:
    """Send one request; (outcome: ok | 4xx | unexpected, error text)."""
    path, body, stream, expect_4xx = build_request(kind, rng, vocab)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    try:
        if not stream:
            r = await client.post(url + path, timeout=REQUEST_TIMEOUT_S, **kw)
            if expect_4xx:
                if 400 <= r.status_code < 500:
                    return "4xx", ""
                return "unexpected", f"HTTP {r.status_code} for a bad input {str(body)[:80]}"
            if r.status_code != 200:
                return "unexpected", f"HTTP {r.status_code}: {r.text[:200]}"
            choices = r.json().get("choices") or []
            return ("ok", "") if choices else ("unexpected", "no choices")
        async with client.stream("POST", url + path, timeout=REQUEST_TIMEOUT_S, **kw) as resp:
            if resp.status_code != 200:
                return "unexpected", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            drop_after = rng.randint(1, 3) if kind == "abort" else None
            n, done = 0, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "unexpected", f"in-band error {json.dumps(chunk['error'])[:200]}"
                n += 1
                if drop_after is not None and n >= drop_after:
                    return "ok", ""            # leaving the block closes the connection: the server aborts
            return ("ok", "") if done else ("unexpected", "stream ended without [DONE]")
    except Exception as e:         # a failed request is a count, not a crash
        return "unexpected", f"{type(e).__name__}: {e}"


async def drive(url: str, spec: SoakSpec, vocab: int, stop_at: float, counts: Counts) -> None:
    import httpx
    kinds, weights = list(MIX), list(MIX.values())

    async def client_task(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(spec.seed * 1000 + i)
        while time.monotonic() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            outcome, err = await one_request(client, url, kind, rng, vocab)
            counts.note(kind, outcome, err)

    limits = httpx.Limits(max_connections=spec.clients, max_keepalive_connections=spec.clients)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(client_task(i, client) for i in range(spec.clients)))


# ================================================================== sampling
class Sampler(threading.Thread):
    """Every `every_s`: RSS of each process, and (with probes) each replica's probe; prints a progress line."""

    def __init__(self, spec: SoakSpec, pids: dict[str, int], t0: float, counts: Counts, warm_end: float):
        super().__init__(daemon=True)
        self.spec, self.pids, self.t0, self.counts, self.warm_end = spec, pids, t0, counts, warm_end
        self.samples: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def sample(self) -> dict[str, Any]:
        t = time.monotonic() - self.t0
        s: dict[str, Any] = {"t": round(t, 2), "phase": "warmup" if time.monotonic() < self.warm_end else "soak",
                             "requests": self.counts.sent, "unexpected": self.counts.unexpected,
                             "rss_mb": {n: read_rss_mb(p) for n, p in self.pids.items()}}
        if self.spec.probe:
            try:
                s["probe"] = {n: {"heap_in_use_mb": p["malloc"].get("heap_in_use", 0) / 2**20,
                                  "heap_free_kept_mb": p["malloc"].get("heap_free_kept", 0) / 2**20,
                                  "mmapped_mb": p["malloc"].get("mmapped", 0) / 2**20,
                                  "arena_mb": p["malloc"].get("arena", 0) / 2**20,
                                  "gc_objects": p["gc_objects"], "containers": p["containers"]}
                              for n, p in probes(self.spec.replicas, self.pids).items()}
            except Exception as e:       # a probe that failed is a gap in the record, not a failed run
                s["probe_error"] = f"{type(e).__name__}: {e}"
        self.samples.append(s)
        rss = " ".join(f"{n} {v:.0f}" for n, v in s["rss_mb"].items() if v is not None)
        heap = ""
        if "probe" in s:
            heap = "; heap in use / free kept MB: " + " ".join(
                f"{n} {p['heap_in_use_mb']:.0f}/{p['heap_free_kept_mb']:.0f}" for n, p in s["probe"].items())
        print(f"[soak] t={t:5.0f}s {s['phase']:6s} requests {s['requests']} (unexpected {s['unexpected']}); "
              f"RSS MB: {rss}{heap}", file=sys.stderr, flush=True)
        return s

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.spec.sample_s)


# ================================================================== report
def analyze(samples: list[dict[str, Any]], t_warm: float, flat: float) -> dict[str, dict[str, Any]]:
    names = list(samples[0]["rss_mb"]) if samples else []
    out = {}
    for name in names:
        pts = [(s["t"], s["rss_mb"][name], s["requests"]) for s in samples if s["rss_mb"].get(name) is not None]
        out[name] = analyze_series([p[0] for p in pts], [p[1] for p in pts], t_warm, flat, [p[2] for p in pts])
    # the replicas' live native heap too (what malloc hands out to live allocations, not what it keeps)
    for name in names:
        pts = [(s["t"], s["probe"][name]["heap_in_use_mb"], s["requests"]) for s in samples
               if name in s.get("probe", {})]
        if len([p for p in pts if p[0] >= t_warm]) >= 2:
            out[f"{name} heap in use"] = analyze_series([p[0] for p in pts], [p[1] for p in pts], t_warm, flat,
                                                        [p[2] for p in pts])
    return out


def plot(samples: list[dict[str, Any]], t_warm: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    warm_reqs = next((s["requests"] for s in samples if s["t"] >= t_warm), 0) / 1000
    for ax, x, xlabel, xwarm in ((axes[0], lambda s: s["t"] / 60, "minutes", t_warm / 60),
                                 (axes[1], lambda s: s["requests"] / 1000, "requests sent (thousands)", warm_reqs)):
        for i, name in enumerate(samples[0]["rss_mb"]):
            pts = [(x(s), s["rss_mb"][name]) for s in samples if s["rss_mb"].get(name) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{name} RSS", color=f"C{i}")
            hp = [(x(s), s["probe"][name]["heap_in_use_mb"]) for s in samples if name in s.get("probe", {})]
            if hp:
                ax.plot([p[0] for p in hp], [p[1] for p in hp], label=f"{name} malloc in use", color=f"C{i}",
                        linestyle=":")
        ax.axvline(xwarm, color="gray", linestyle="--", linewidth=1, label="end of warm-up")
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="MB", title="Memory over time")
    axes[1].set(title="Memory over requests")
    axes[1].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report_from_json(path: str, flat: float, png: str | None) -> None:
    """The table (and figure) of an earlier run, from its --json (no Ray)."""
    doc = json.loads(Path(path).read_text())
    rows = analyze(doc["samples"], doc["spec"]["warmup_s"], flat)
    for name, r in doc.get("rows", {}).items():
        if name in rows and r.get("trimmed_mb") is not None:
            rows[name]["trimmed_mb"] = r["trimmed_mb"]
    print(rss_table(rows))
    if png:
        plot(doc["samples"], doc["spec"]["warmup_s"], png)


def run(spec: SoakSpec) -> dict[str, Any]:
    from affinity_serve.engine import ensure_demo_model
    vocab = json.loads((Path(ensure_demo_model()) / "config.json").read_text())["vocab_size"]
    t_start = time.monotonic()
    url, _ = start(spec)
    try:
        pids = find_pids(spec.replicas)
        print(f"[soak] deployed in {time.monotonic() - t_start:.0f} s; pids {pids}", file=sys.stderr, flush=True)
        counts = Counts()
        t0 = time.monotonic()
        warm_end = t0 + spec.warmup_s
        stop_at = warm_end + spec.minutes * 60
        sampler = Sampler(spec, pids, t0, counts, warm_end)
        base_detail: dict[str, Any] = {}

        def detail_at_warm_end() -> None:      # object types by count as the measured window opens
            time.sleep(max(0.0, warm_end - time.monotonic()))
            if spec.probe:
                base_detail.update(probes(spec.replicas, pids, detail=True,
                                          trace="start" if spec.tracemalloc else ""))
        sampler.start()
        warm_probe = threading.Thread(target=detail_at_warm_end, daemon=True)
        warm_probe.start()
        asyncio.run(drive(url, spec, vocab, stop_at, counts))
        sampler.stop_event.set()
        sampler.join()
        warm_probe.join()
        sampler.sample()                       # the last point, at the end of the traffic
        t_warm = spec.warmup_s
        kv = kv_leak_check(spec.replicas)
        end_detail = (probes(spec.replicas, pids, detail=True, trim=True,
                             trace="report" if spec.tracemalloc else "") if spec.probe else {})
        ingress_rss = {n: read_rss_mb(p) for n, p in pids.items()}
    finally:
        stop()
    rows = analyze(sampler.samples, t_warm, spec.flat_mb_per_min)
    growth = {}
    for name, d in end_detail.items():
        rows[name]["trimmed_mb"] = d.get("rss_after_trim_mb")
        b = base_detail.get(name, {})
        growth[name] = {"types": grown_types(b.get("types", {}), d.get("types", {})),
                        "containers": grown_containers(b.get("containers", {}), d.get("containers", {})),
                        "gc_objects": (b.get("gc_objects"), d.get("gc_objects")),
                        "malloc_end": d.get("malloc"), "malloc_after_trim": d.get("malloc_after_trim"),
                        "tracemalloc": d.get("tracemalloc")}
    return {"spec": asdict(spec), "counts": asdict(counts), "kv_leak_check": kv, "rows": rows,
            "growth_since_warmup": growth, "rss_after_traffic_mb": ingress_rss, "samples": sampler.samples,
            "total_s": time.monotonic() - t_start}


def main() -> None:
    d = SoakSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=d.minutes, help="measured soak, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s)
    p.add_argument("--sample-s", type=float, default=d.sample_s)
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--clients", type=int, default=d.clients, help="client tasks (one request each at a time)")
    p.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads per replica")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--flat-mb-per-min", type=float, default=d.flat_mb_per_min)
    p.add_argument("--no-probe", action="store_true", help="plain LLMReplica: RSS only")
    p.add_argument("--tracemalloc", action="store_true",
                   help="diagnosis: trace the replicas' Python allocations after the warm-up and print the "
                        "biggest still alive at the end (slows the replicas down)")
    p.add_argument("--linear-backend", default=d.linear_backend, choices=("auto", "torch", "onednn", "hybrid"),
                   help="the replicas' engine.linear_backend")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in the environment of the local Ray's processes, replicas included (repeatable), "
                        "e.g. ONEDNN_PRIMITIVE_CACHE_CAPACITY=64")
    p.add_argument("--json", help="write the results (every sample included) here")
    p.add_argument("--png", help="write RSS over time here")
    p.add_argument("--from-json", metavar="PATH", help="no run: analyze the samples of an earlier run's --json")
    a = p.parse_args()
    if a.from_json:
        report_from_json(a.from_json, a.flat_mb_per_min, a.png)
        return
    if not 1 <= a.clients <= 64:
        p.error("--clients must be 1..64")
    if any("=" not in kv for kv in a.env):
        p.error("--env takes NAME=VALUE")
    spec = SoakSpec(minutes=a.minutes, warmup_s=a.warmup_s, sample_s=a.sample_s, replicas=a.replicas,
                    clients=a.clients, num_threads=a.num_threads, seed=a.seed, flat_mb_per_min=a.flat_mb_per_min,
                    probe=not a.no_probe, tracemalloc=a.tracemalloc,
                    env=tuple(tuple(kv.split("=", 1)) for kv in a.env), linear_backend=a.linear_backend)
    res = run(spec)
    c = res["counts"]
    print(f"requests: {c['sent']} sent, {c['ok']} ok, {c['expected_4xx']} bad inputs refused with a 4xx, "
          f"{c['unexpected']} unexpected; by kind {c['by_kind']}")
    for e in c["errors"] or []:
        print(f"  unexpected: {e}")
    kv = res["kv_leak_check"]
    print(f"KV blocks after the traffic: {'no leak' if kv['ok'] else 'LEAK'} "
          + "; ".join(f"{rid[:8]} free {r['num_free_blocks']}/{r['num_blocks'] - 1}, requests {r['num_requests']}"
                      for rid, r in kv["replicas"].items()))
    print(rss_table(res["rows"]))
    for name, g in res["growth_since_warmup"].items():
        print(f"{name}: gc objects {g['gc_objects'][0]} -> {g['gc_objects'][1]}; containers grown "
              f"{g['containers'] or 'none'}; types grown most {g['types'][:6]}")
        tm = g.get("tracemalloc")
        if tm:
            print(f"{name}: Python allocations alive since the warm-up (tracemalloc): {tm['traced_mb']:.1f} MB; top:")
            for st in tm["top"][:6]:
                print(f"  {st['size_mb']:.2f} MB in {st['count']} blocks: {' <- '.join(reversed(st['frames'][-4:]))}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    if a.png:
        plot(res["samples"], spec.warmup_s, a.png)
    if c["unexpected"] or not kv["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
