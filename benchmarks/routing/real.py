"""Routing on a real local cluster: the demo model on N Serve replicas (127.0.0.1 only), one trace replayed
over HTTP under each routing policy in turn, in one run.

Per policy the app is deployed fresh (new engines: empty prefix caches, counters from zero, a new router),
warmed up with a few requests that share nothing with the trace, driven with the same seeded trace at a
bounded concurrency (streaming completions), measured, and deleted. Token hit rate comes from the engines'
own counters (each replica's `prefix_cache_hits_total / prefix_cache_queries_total` (EngineLoad), deltas over the
trace); TTFT is the time to the first chunk carrying text; throughput is output tokens per second of wall
time. `power_of_two` (Serve's default behaviour) and `round_robin` are the baselines.

The trace: `--tenants` system prompts (token ids, about `--system-tokens` each) with Zipf popularity, each
request one of them plus a short question, `--max-tokens` lo..hi output tokens (ignore_eos). The KV pool
(`--num-blocks` per replica) holds about half of all system prompts: a replica that sees every tenant
thrashes, one that sees half of them keeps its tenants cached.

`--rate R` replays the trace open loop instead: Poisson arrivals at R requests per second, each request sent
at its arrival whatever is in flight, so queues build as they do under production overload (a closed loop
slows its own arrivals down). `--doc-share F` puts a unique document (no reuse; lognormal length with a
heavy tail, `--doc-tokens median,sigma,lo,hi`) between the system prompt and the question of that share of
the requests: the long cold prefills that set a TTFT tail.

`--emulate`: each replica's engine is paced to an emulated device (`engine.pace`: prefill 1 ms per token, a
decode step 50 ms + 25 us per context token), so a prefix hit saves what it saves on a GPU relative to the
step and TTFT differences between routers show above the CPU's noise; 4-6 replicas fit on 2 cores. Its
default policies add the llm-d-style baseline (`llm_d_precise`: sticky to the holder until saturated).

    python -m benchmarks.routing.real --json real.json --png real.png
    python -m benchmarks.routing.real --emulate --replicas 4 --json real_emulated.json
    python -m benchmarks.routing.real --emulate --replicas 4 --rate 5 --doc-share 0.3 --num-blocks 600
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.routing.workload import FIRST_TOKEN_ID, TraceRequest
from benchmarks.serve_wait import wait_running

POLICIES = ("prefix_affinity", "power_of_two", "round_robin")
EMULATED_POLICIES = ("prefix_affinity", "llm_d_precise", "power_of_two")
#: engine.pace of an --emulate run (benchmarks/autoscale_real.py's emulated device)
EMULATED_PACE = {"enabled": True, "step_base_s": 0.05, "prefill_per_token_s": 1e-3,
                 "decode_per_context_token_s": 25e-6}
APP_NAME = "routing-bench"
ROUTE = "/bench"
NUM_WARMUP_REQUESTS = 6
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class BenchSpec:
    replicas: int = 2
    num_threads: int = 1
    num_blocks: int = 96                 # per replica, incl. the null block
    block_size: int = 16
    tenants: int = 8
    system_tokens: int = 240             # median; each tenant's is within ±20%
    question_tokens: tuple[int, int] = (8, 32)
    max_tokens: tuple[int, int] = (8, 16)
    zipf_alpha: float = 0.8
    requests: int = 400
    concurrency: int = 8
    seed: int = 0
    time_limit_s: float = 240.0          # the whole run, start-up included
    request_timeout_s: float = 60.0
    policies: tuple[str, ...] = POLICIES
    affinity: tuple[tuple[str, Any], ...] = ()      # routing.affinity knobs to override (name, JSON value)
    emulate: bool = False                # replicas paced to an emulated device (EMULATED_PACE)
    rate: float = 0.0                    # > 0: open loop, Poisson arrivals at this many requests per second
    doc_share: float = 0.0               # this share of the requests carries a unique document
    doc_tokens: tuple[float, float, int, int] = (300.0, 1.0, 64, 1500)    # lognormal: median, sigma, lo, hi
    max_model_len: int = 2048            # the demo model's context: every prompt + max_tokens must fit


@dataclass(slots=True)
class RequestResult:
    req_id: str
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    replica_id: str = ""
    error: str = ""


@dataclass(slots=True)
class PolicyResult:
    policy: str
    num_sent: int
    num_completed: int
    num_failed: int
    wall_s: float
    token_hit_rate: float                # engines' counters: hits / queries over the trace
    prefix_cache_queries: int
    prefix_cache_hits: int
    usage_hit_rate: float                # the responses' usage.cached_tokens / prompt tokens (cross-check)
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    requests_per_replica: dict[str, int]
    ttfts_ms: list[float] = field(repr=False)
    errors: list[str] = field(default_factory=list)
    router: dict[str, Any] = field(default_factory=dict)    # the ingress router's counters after the trace
    #: TTFT over the trace after its first 2 x concurrency requests (the cold start's burst of cold
    #: prompts, all sent at once, dominates a p99 over 300 requests otherwise)
    ttft_p50_steady_ms: float = float("nan")
    ttft_p99_steady_ms: float = float("nan")
    #: open loop: TTFT of the requests with a document (the long cold prefills), after the cold start
    ttft_p99_doc_ms: float = float("nan")


# ================================================================== trace
def build_trace(spec: BenchSpec, vocab_size: int) -> list[TraceRequest]:
    """Seeded tenant trace: Zipf-popular system prompts + short questions, `doc_share` of them with a unique
    document in between; arrival times 0 (closed loop) or Poisson at `spec.rate`. The documents and the
    arrivals come from their own generators, so a closed-loop trace without documents is the same as ever."""
    if spec.rate < 0:
        raise ValueError(f"--rate {spec.rate:g}: requests per second must be >= 0 (0: closed loop)")
    if not 0 <= spec.doc_share <= 1:
        raise ValueError(f"--doc-share {spec.doc_share:g}: a share of the requests, between 0 and 1")
    rng = np.random.default_rng(spec.seed)
    doc_rng = np.random.default_rng(spec.seed + 1)
    arrival_rng = np.random.default_rng(spec.seed + 2)

    def tokens(n: int, g: np.random.Generator = rng) -> list[int]:
        return g.integers(FIRST_TOKEN_ID, vocab_size, n).tolist()

    systems = [tokens(int(spec.system_tokens * rng.uniform(0.8, 1.2))) for _ in range(spec.tenants)]
    weights = 1.0 / np.arange(1, spec.tenants + 1) ** spec.zipf_alpha
    picks = rng.choice(spec.tenants, size=spec.requests, p=weights / weights.sum())
    median, sigma, lo, hi = spec.doc_tokens
    longest = max(len(x) for x in systems) + (int(hi) if spec.doc_share > 0 else 0) + spec.question_tokens[1] \
        + spec.max_tokens[1]
    if longest > spec.max_model_len:
        raise ValueError(f"the longest request ({longest} tokens: system prompt + document + question + output) "
                         f"does not fit the model's {spec.max_model_len}: lower --system-tokens or the "
                         f"document's upper bound (--doc-tokens)")
    t = 0.0
    out = []
    for i, k in enumerate(picks):
        question = tokens(int(rng.integers(spec.question_tokens[0], spec.question_tokens[1] + 1)))
        output = [0] * int(rng.integers(spec.max_tokens[0], spec.max_tokens[1] + 1))   # only its length is used
        doc: list[int] = []
        if spec.doc_share > 0 and doc_rng.random() < spec.doc_share:
            n = int(np.clip(median * np.exp(sigma * doc_rng.standard_normal()), lo, hi))
            doc = tokens(n, doc_rng)
        if spec.rate > 0:
            t += float(arrival_rng.exponential(1.0 / spec.rate))
        out.append(TraceRequest(f"R{i:05d}", t, "D" if doc else "A", f"tenant{k}", systems[k] + doc + question,
                                output))
    return out


def offered_load(spec: BenchSpec, trace: list[TraceRequest]) -> float:
    """The arrival rate over the fleet's no-cache prefill rate on the emulated device (prefill only: the
    decode steps' base time makes the real saturation a little lower); nan when closed loop or not emulated
    (the CPU's own prefill rate is not modelled)."""
    if spec.rate <= 0 or not spec.emulate or not trace:
        return float("nan")
    mean_prompt = sum(len(r.prompt_token_ids) for r in trace) / len(trace)
    per_replica_rps = 1.0 / (EMULATED_PACE["prefill_per_token_s"] * mean_prompt)
    return spec.rate / (spec.replicas * per_replica_rps)


def hit_rate_bound(trace: list[TraceRequest], block_size: int) -> float:
    """Token hit rate of one shared, unbounded cache over the trace in order: every full block seen before
    is a hit (the upper bound for any router; cold misses and each prompt's unique tail still miss)."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        ids, chain, hitting = r.prompt_token_ids, 0, True
        for end in range(block_size, len(ids) + 1, block_size):
            chain = hash((chain, tuple(ids[end - block_size:end])))
            hitting = hitting and chain in seen
            hits += block_size if hitting else 0
            seen.add(chain)
        total += len(ids)
    return hits / total if total else 0.0


def warmup_trace(spec: BenchSpec, vocab_size: int) -> list[TraceRequest]:
    """Requests sharing nothing with the trace (another seed): they warm the replicas' kernels only."""
    rng = np.random.default_rng(spec.seed + 10_000)
    return [TraceRequest(f"W{i}", 0.0, "D", "", rng.integers(FIRST_TOKEN_ID, vocab_size, 64).tolist(), [0] * 4)
            for i in range(NUM_WARMUP_REQUESTS)]


# ================================================================== cluster
def start_cluster(spec: BenchSpec) -> str:
    """Ray + Serve on 127.0.0.1 (a free port); returns the HTTP base URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=spec.replicas + 2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    return f"http://127.0.0.1:{port}{ROUTE}"


def stop_cluster() -> None:
    import ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()


def shared_store_dir() -> str:
    """The node-shared KV store of a `<policy>+shared` run (emptied before each deploy and after it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"affinity-kv-bench-{os.getpid()}")


def app_config(spec: BenchSpec, policy: str, model: str) -> dict[str, Any]:
    """`policy` is a routing.policy, or one followed by "+shared": the replicas share a node KV store
    (engine.kv_connector type shared, 4x a replica's pool)."""
    policy, _, tier = policy.partition("+")
    engine = {"model": model, "num_threads": spec.num_threads,
              "cache": {"num_blocks": spec.num_blocks, "block_size": spec.block_size}}
    if tier == "shared":
        engine["kv_connector"] = {"type": "shared", "shared_dir": shared_store_dir(),
                                  "capacity_blocks": 4 * spec.num_blocks}
    elif tier:
        raise ValueError(f"unknown tier {tier!r} in policy {policy}+{tier}; use <policy>+shared")
    affinity = dict(spec.affinity)
    if spec.emulate:
        engine["pace"] = dict(EMULATED_PACE)
        # the router's TTFT prior: the emulated device's prefill rate (it calibrates online from there)
        affinity.setdefault("prefill_tokens_per_s", 1.0 / EMULATED_PACE["prefill_per_token_s"])
    return {"engine": engine,
            "serve": {"num_replicas": spec.replicas, "replica_num_cpus": 0.25 if spec.emulate else 1.0,
                      "model_name": "demo",
                      "max_queued_requests": -1, "first_token_timeout_s": spec.request_timeout_s},
            "routing": {"policy": policy, "request_routing_stats_period_s": 0.5, "affinity": affinity},
            "observability": {"traces": "none", "log_level": "WARNING"}}


def deploy(spec: BenchSpec, policy: str, model: str) -> None:
    from ray import serve

    from affinity_serve.app.builder import build_app
    shutil.rmtree(shared_store_dir(), ignore_errors=True)        # every run starts from an empty store
    serve.run(build_app(app_config(spec, policy, model)), name=APP_NAME, route_prefix=ROUTE)
    _wait_running("LLMReplica", spec.replicas)


def undeploy() -> None:
    from ray import serve
    serve.delete(APP_NAME)
    shutil.rmtree(shared_store_dir(), ignore_errors=True)


def _wait_running(deployment: str, n: int, timeout_s: float = 120) -> None:
    wait_running(APP_NAME, deployment, n, timeout_s)


def replica_counters(num_replicas: int, max_calls: int = 100) -> dict[str, tuple[int, int]]:
    """Replica id -> (prefix_cache_queries, prefix_cache_hits), from each replica's own `debug_state`.

    A handle call lands on one replica (load-only ranking for calls without a prompt), so call until every
    replica answered; the trace is idle by then, so the counters do not move between calls.
    """
    from ray import serve
    h = serve.get_deployment_handle("LLMReplica", APP_NAME)
    seen: dict[str, tuple[int, int]] = {}
    for _ in range(max_calls):
        st = h.debug_state.remote().result(timeout_s=30)
        seen[st["replica_id"]] = (st["stats"]["prefix_cache_queries_total"],
                                      st["stats"]["prefix_cache_hits_total"])
        if len(seen) == num_replicas:
            return seen
    raise RuntimeError(f"only {len(seen)} of {num_replicas} replicas answered debug_state in {max_calls} calls")


def router_line(c: dict[str, Any]) -> str:
    """The router counters' line: decisions by reason, index accuracy (n/a for a load-only policy, whose
    state reports it as null) and the calibrated prefill rate."""
    acc = c.get("index_accuracy")
    return (f"{c.get('by_reason')}, index accuracy {'n/a' if acc is None else f'{acc:.2f}'}, prefill "
            f"{c.get('prefill_tokens_per_s', 0.0):.0f} tok/s (calibrated)")


def router_counters() -> dict[str, Any]:
    """The (one) ingress replica's router counters: decisions by reason, index accuracy, feed counters."""
    from ray import serve
    state = serve.get_app_handle(APP_NAME).routing_decisions.remote(0).result(timeout_s=30)
    return {k: v for k, v in (state["routers"] or [{}])[0].items() if k in ("policy", "counters", "feed")}


# ================================================================== HTTP driver
async def _one_request(client: Any, url: str, r: TraceRequest, timeout_s: float) -> RequestResult:
    body = {"model": "demo", "prompt": r.prompt_token_ids, "max_tokens": len(r.output_token_ids),
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(r.req_id, ok=False, num_prompt_tokens=len(r.prompt_token_ids))
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _read_chunk(json.loads(line[6:]), res, time.perf_counter() - start)
        res.e2e_s = time.perf_counter() - start
        res.ok = res.ttft_s is not None and res.num_output_tokens == len(r.output_token_ids)
        if not res.ok:
            res.error = f"incomplete: {res.num_output_tokens} of {len(r.output_token_ids)} tokens"
    except Exception as e:          # a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


def _read_chunk(chunk: dict, res: RequestResult, elapsed_s: float) -> None:
    if "error" in chunk:
        res.error = json.dumps(chunk["error"])[:200]
    if chunk.get("system_fingerprint"):
        res.replica_id = chunk["system_fingerprint"].removeprefix("replica:")
    if res.ttft_s is None and any(c.get("text") for c in chunk.get("choices") or []):
        res.ttft_s = elapsed_s
    usage = chunk.get("usage")
    if usage:
        res.num_output_tokens = usage["completion_tokens"]
        res.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def drive(url: str, trace: list[TraceRequest], concurrency: int, deadline: float, timeout_s: float,
                label: str) -> tuple[list[RequestResult], float]:
    """Replay `trace` in order with `concurrency` requests in flight; stop sending at `deadline` (monotonic).
    Returns the results of the requests sent, and the wall time."""
    import httpx
    results: list[RequestResult] = []
    next_idx = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_idx
        while next_idx < len(trace) and time.monotonic() < deadline:
            r = trace[next_idx]
            next_idx += 1
            results.append(await _one_request(client, url, r, min(timeout_s, max(1.0, deadline - time.monotonic()))))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.monotonic()    # after the client is built, as in drive_open
        await _with_progress(asyncio.gather(*(worker(client) for _ in range(concurrency))), results, len(trace),
                             start, label)
    return results, time.monotonic() - start


async def drive_open(url: str, trace: list[TraceRequest], deadline: float, timeout_s: float,
                     label: str) -> tuple[list[RequestResult], float]:
    """Send each request of `trace` at its arrival time (seconds from now), whatever is in flight; no new
    request after `deadline` (monotonic). Returns the results of the requests sent, and the wall time."""
    import httpx
    results: list[RequestResult] = []
    start = 0.0

    async def one(client: httpx.AsyncClient, r: TraceRequest) -> None:
        due = start + r.arrival_s
        if due >= deadline:
            return
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        results.append(await _one_request(client, url, r, min(timeout_s, max(1.0, deadline - time.monotonic()))))

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.monotonic()    # after the client is built (its TLS setup can take 0.3 s on a busy machine)
        await _with_progress(asyncio.gather(*(one(client, r) for r in trace)), results, len(trace), start, label)
    return results, time.monotonic() - start


async def _with_progress(work: Any, results: list[RequestResult], total: int, start: float, label: str) -> None:
    """Await `work`, printing a progress line every PROGRESS_EVERY_S meanwhile."""
    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            failed = sum(not r.ok for r in results)
            print(f"  [{label}] {len(results)}/{total} done, {failed} failed, "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    ticker = asyncio.create_task(progress())
    try:
        await work
    finally:
        ticker.cancel()


# ================================================================== one policy
def run_policy(spec: BenchSpec, policy: str, model: str, url: str, trace: list[TraceRequest],
               warmup: list[TraceRequest], deadline: float) -> PolicyResult:
    t0 = time.monotonic()
    deploy(spec, policy, model)
    print(f"[{policy}] deployed {spec.replicas} replicas in {time.monotonic() - t0:.1f} s", file=sys.stderr,
          flush=True)
    try:
        asyncio.run(drive(url, warmup, len(warmup), deadline, spec.request_timeout_s, f"{policy} warmup"))
        before = replica_counters(spec.replicas)
        if spec.rate > 0:
            results, wall = asyncio.run(drive_open(url, trace, deadline, spec.request_timeout_s, policy))
        else:
            results, wall = asyncio.run(drive(url, trace, spec.concurrency, deadline, spec.request_timeout_s,
                                              policy))
        after = replica_counters(spec.replicas)
        router = router_counters()
    finally:
        undeploy()
    docs = {r.req_id for r in trace if r.component == "D"}
    out = summarize(policy, results, wall, before, after, skip=cold_start_requests(spec), doc_ids=docs)
    out.router = router
    print(f"[{policy}] {out.num_completed} ok, {out.num_failed} failed in {wall:.1f} s; hit rate "
          f"{out.token_hit_rate:.3f}, TTFT p50 {out.ttft_p50_ms:.0f} ms p99 {out.ttft_p99_ms:.0f} ms",
          file=sys.stderr, flush=True)
    if out.router.get("counters"):
        print(f"[{policy}] router: {router_line(out.router['counters'])}", file=sys.stderr, flush=True)
    for e in out.errors:
        print(f"[{policy}] failure: {e}", file=sys.stderr, flush=True)
    return out


def cold_start_requests(spec: BenchSpec) -> int:
    """How many of the trace's first requests the steady-state figures leave out: closed loop, the first
    2 x concurrency (all sent at once on cold caches); open loop, the first tenth."""
    return spec.requests // 10 if spec.rate > 0 else 2 * spec.concurrency


def summarize(policy: str, results: list[RequestResult], wall_s: float, before: dict[str, tuple[int, int]],
              after: dict[str, tuple[int, int]], skip: int = 0, doc_ids: set[str] | frozenset = frozenset()
              ) -> PolicyResult:
    """`skip`: the first requests of the trace (by id) left out of the steady-state TTFT figures;
    `doc_ids`: the requests with a document (their own steady-state TTFT p99)."""
    ok = [r for r in results if r.ok]
    steady_ok = sorted(ok, key=lambda r: r.req_id)[skip:]
    steady = sorted(r.ttft_s * 1e3 for r in steady_ok)
    doc_steady = [r.ttft_s * 1e3 for r in steady_ok if r.req_id in doc_ids]
    queries = sum(q - before.get(rid, (0, 0))[0] for rid, (q, _) in after.items())
    hits = sum(h - before.get(rid, (0, 0))[1] for rid, (_, h) in after.items())
    ttfts = sorted(r.ttft_s * 1e3 for r in ok)
    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica_id] = per_replica.get(r.replica_id, 0) + 1

    def pct(xs: list[float], p: float) -> float:
        return float(np.percentile(xs, p)) if xs else float("nan")

    return PolicyResult(
        policy=policy, num_sent=len(results), num_completed=len(ok), num_failed=len(results) - len(ok),
        wall_s=wall_s, token_hit_rate=hits / queries if queries else 0.0, prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        usage_hit_rate=sum(r.num_cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_ms=pct(ttfts, 50), ttft_p99_ms=pct(ttfts, 99), e2e_p50_ms=pct([r.e2e_s * 1e3 for r in ok], 50),
        output_tokens_per_s=sum(r.num_output_tokens for r in ok) / wall_s, requests_per_s=len(ok) / wall_s,
        requests_per_replica=dict(sorted(per_replica.items())), ttfts_ms=ttfts,
        errors=sorted({r.error for r in results if not r.ok})[:5],
        ttft_p50_steady_ms=pct(steady, 50), ttft_p99_steady_ms=pct(steady, 99),
        ttft_p99_doc_ms=pct(doc_steady, 99))


# ================================================================== report
def table(results: list[PolicyResult]) -> str:
    head = ("| policy | ok / sent | failed | token hit rate | TTFT p50 ms | TTFT p99 ms | after the cold start: p50 / "
            "p99 ms | with a document: p99 ms | output tok/s | requests per replica |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = [f"| {r.policy} | {r.num_completed} / {r.num_sent} | {r.num_failed} | {r.token_hit_rate:.3f} | "
            f"{r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.ttft_p50_steady_ms:.0f} / {r.ttft_p99_steady_ms:.0f} | "
            f"{r.ttft_p99_doc_ms:.0f} | {r.output_tokens_per_s:.0f} | "
            f"{' / '.join(str(n) for n in r.requests_per_replica.values())} |" for r in results]
    return "\n".join([head, *rows])


def ratios(results: list[PolicyResult], ours: str = "prefix_affinity") -> dict[str, dict[str, float]]:
    """Ours over each baseline: hit rate and throughput (higher is better), TTFT (lower is better)."""
    by = {r.policy: r for r in results}
    if ours not in by:
        return {}
    o = by[ours]

    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {p: {"token_hit_rate": div(o.token_hit_rate, b.token_hit_rate),
                "ttft_p50": div(o.ttft_p50_ms, b.ttft_p50_ms), "ttft_p99": div(o.ttft_p99_ms, b.ttft_p99_ms),
                "ttft_p99_after_cold_start": div(o.ttft_p99_steady_ms, b.ttft_p99_steady_ms),
                "ttft_p50_after_cold_start": div(o.ttft_p50_steady_ms, b.ttft_p50_steady_ms),
                "output_tokens_per_s": div(o.output_tokens_per_s, b.output_tokens_per_s)}
            for p, b in by.items() if p != ours}


def ratio_lines(rs: dict[str, dict[str, float]]) -> str:
    return "\n".join(f"prefix_affinity vs {p}: hit rate {r['token_hit_rate']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, "
                     f"p99 {r['ttft_p99']:.2f}x (after the cold start {r['ttft_p99_after_cold_start']:.2f}x), "
                     f"throughput {r['output_tokens_per_s']:.2f}x (TTFT < 1 is better)"
                     for p, r in rs.items())


def plot(results: list[PolicyResult], bound: float, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no PNG", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for r in results:
        if r.ttfts_ms:
            ax1.plot(r.ttfts_ms, np.arange(1, len(r.ttfts_ms) + 1) / len(r.ttfts_ms), label=r.policy)
    ax1.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax1.grid(alpha=0.3)
    ax1.legend()
    bars = ax2.bar([r.policy for r in results], [r.token_hit_rate for r in results],
                   color=[f"C{i}" for i in range(len(results))])
    ax2.bar_label(bars, fmt="%.3f")
    ax2.axhline(bound, color="gray", linestyle="--", linewidth=1, label=f"bound {bound:.3f}")
    ax2.legend(loc="lower right")
    ax2.set(ylim=(0, 1), ylabel="token hit rate (engine counters)", title="Prefix cache hit rate")
    ax2.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ================================================================== main
def run(spec: BenchSpec) -> tuple[list[PolicyResult], float]:
    """Every policy in turn on one cluster; returns their results and the trace's hit rate bound."""
    from affinity_serve.engine import ensure_demo_model
    start = time.monotonic()
    deadline = start + spec.time_limit_s
    model = str(ensure_demo_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    trace, warmup = build_trace(spec, vocab), warmup_trace(spec, vocab)
    bound = hit_rate_bound(trace, spec.block_size)
    prefix_blocks = spec.tenants * spec.system_tokens // spec.block_size
    print(f"trace: {len(trace)} requests, {spec.tenants} tenants x ~{spec.system_tokens} tokens "
          f"(~{prefix_blocks} blocks of prefixes) on {spec.replicas} replicas x {spec.num_blocks - 1} KV blocks; "
          + (f"open loop at {spec.rate:g} requests/s over {trace[-1].arrival_s:.0f} s"
             + (f" (~{offered_load(spec, trace):.2f}x the fleet's no-cache prefill rate)" if spec.emulate else "")
             + f", {sum(r.component == 'D' for r in trace)} with a document; "
             if spec.rate > 0 else f"concurrency {spec.concurrency}; ")
          + f"hit rate bound (one unbounded cache) {bound:.3f}", file=sys.stderr, flush=True)
    url = start_cluster(spec)
    results = []
    try:
        for i, policy in enumerate(spec.policies):
            # each remaining policy gets an equal share of the time left, so a slow one cannot starve the rest
            share = (deadline - time.monotonic()) / (len(spec.policies) - i)
            results.append(run_policy(spec, policy, model, url, trace, warmup, time.monotonic() + share))
    finally:
        stop_cluster()
    print(f"total {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return results, bound


def _doc_tokens(text: str) -> tuple[float, float, int, int]:
    try:
        median, sigma, lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--doc-tokens {text!r}: expected median,sigma,lo,hi, e.g. 300,1.0,64,1500") from None
    if not (0 < lo <= median <= hi and sigma >= 0):
        raise SystemExit(f"--doc-tokens {text!r}: need 0 < lo <= median <= hi and sigma >= 0")
    return median, sigma, int(lo), int(hi)


def _hard_stop(signum: int, frame: Any) -> None:
    raise TimeoutError("hard time limit reached")


def main() -> None:
    d = BenchSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads per replica")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks per replica")
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-limit-s", type=float, default=d.time_limit_s, help="hard limit for the whole run")
    p.add_argument("--policies", default=",".join(d.policies),
                   help="routing policies; <policy>+shared also gives the replicas a node-shared KV store")
    p.add_argument("--affinity", action="append", default=[], metavar="KNOB=VALUE",
                   help="override a routing.affinity knob (repeatable), e.g. release_slack_abs_s=0.02")
    p.add_argument("--emulate", action="store_true", help="pace each replica to an emulated device (see above)")
    p.add_argument("--rate", type=float, default=d.rate,
                   help="open loop: Poisson arrivals at this many requests/s (0: closed loop at --concurrency)")
    p.add_argument("--doc-share", type=float, default=d.doc_share,
                   help="share of the requests with a unique document (no reuse) before the question")
    p.add_argument("--doc-tokens", default=",".join(f"{x:g}" for x in d.doc_tokens),
                   help="the document's lognormal length: median,sigma,lo,hi (tokens)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the figure (TTFT CDF, hit rate) here")
    a = p.parse_args()
    policies = a.policies if a.policies != ",".join(d.policies) or not a.emulate else ",".join(EMULATED_POLICIES)
    spec = BenchSpec(replicas=a.replicas, num_threads=a.num_threads, num_blocks=a.num_blocks, tenants=a.tenants,
                     system_tokens=a.system_tokens, requests=a.requests, concurrency=a.concurrency, seed=a.seed,
                     time_limit_s=a.time_limit_s, policies=tuple(policies.split(",")),
                     affinity=tuple((k, json.loads(v)) for k, v in (kv.split("=", 1) for kv in a.affinity)),
                     emulate=a.emulate, rate=a.rate, doc_share=a.doc_share,
                     doc_tokens=_doc_tokens(a.doc_tokens))
    # the hard stop: a hung deploy or shutdown must not outlive the limit by more than a minute
    signal.signal(signal.SIGALRM, _hard_stop)
    signal.alarm(int(spec.time_limit_s) + 60)
    try:
        results, bound = run(spec)
    except ValueError as e:          # a bad flag (the trace's checks, an unknown tier): one line, no traceback
        raise SystemExit(f"error: {e}") from None
    signal.alarm(0)
    print(table(results))
    print(f"token hit rate bound (one shared unbounded cache): {bound:.3f}")
    rs = ratios(results)
    print(ratio_lines(rs))
    if a.json:
        doc = {"spec": asdict(spec), "hit_rate_bound": bound, "ratios_vs_baselines": rs,
               "results": [{k: v for k, v in asdict(r).items() if k != "ttfts_ms"} for r in results]}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.png:
        plot(results, bound, a.png)
    if any(r.num_failed for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
