"""P/D disaggregation against unified serving on a real Ray Serve, every replica paced to an emulated device.

The engine-level benchmark (benchmarks/disagg.py) compares the two schedules with engines in one process.
This one runs the app's own path: the same Poisson trace of long prompts and long outputs goes over the
OpenAI HTTP API (streamed) to a Serve app of N unified replicas, then to a P/D app of the same N replicas
split P:D (ingress -> decode replica -> prefill replica -> KV through Ray's object store -> decode replica).
Every replica's engine steps are held to a modelled device (`engine.pace`, the costs of
benchmarks.disagg.DeviceProfile, dilated by `--time-dilation` so this CPU keeps up), so a replica adds capacity
as a GPU would and a prefill costs what it costs there.

What the app's path adds over the engine-level run, charged at this machine's real (undilated) cost: the
ingress and the decode replica's call to the prefill pool (Serve hops), the prefill replica's `ray.put` and
the decode replica's read of the tiny demo model's KV. The modelled device link of the engine-level run is
not applied here (the object store's real copy of a few MiB is the transfer). Times are reported in device
time (wall / dilation), so a wall millisecond of Serve overhead counts as 1/dilation of a device
millisecond: at dilation 10, the hops weigh ten times less against the device's steps than they would on
GPUs. The unloaded rows (one request at a time, before the trace) show those costs in wall time.

    flock /tmp/affinity-bench.lock .venv/bin/python -m benchmarks.disagg_serve --json out.json --png out.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.disagg import PROFILES, _pct, _trace, paced_costs, verdicts
from benchmarks.serve_wait import wait_running

APP = "disagg-serve-bench"
ROUTE = "/pd"
BLOCK_SIZE = 16


@dataclass(slots=True)
class Result:
    """One trace request as the client saw it (wall seconds from the trace start)."""

    rid: str
    arrival_s: float
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None
    replica: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.token_times) == self.max_tokens


# ---------------------------------------------------------------- the apps
def app_config(args: argparse.Namespace, model: str, num_prefill: int | None,
               local_prefill_slack_s: float | None = None) -> dict[str, Any]:
    """The app's config: N unified replicas (num_prefill None) or num_prefill prefill + N - num_prefill decode
    replicas, every engine paced to the device; the prefill pool with a larger token budget.
    `local_prefill_slack_s`: P/D's conditional disaggregation (wall seconds), None: off."""
    pace = {"enabled": True, "step_base_s": args.step_base_s, "prefill_per_token_s": args.prefill_per_token_s,
            "decode_per_context_token_s": args.decode_per_context_token_s}
    engine = {"model": model, "num_threads": 1, "cache": {"num_blocks": args.num_blocks, "block_size": BLOCK_SIZE},
              "scheduler": {"max_num_batched_tokens": args.budget, "max_num_seqs": 64}, "pace": pace}
    wall_timeout_s = 120.0 * args.time_dilation / 10
    cfg: dict[str, Any] = {
        "engine": engine,
        "serve": {"num_replicas": args.num_replicas, "replica_num_cpus": 0.25, "model_name": "demo",
                  "max_ongoing_requests": 64, "max_queued_requests": -1, "first_token_timeout_s": wall_timeout_s},
        "routing": {"request_routing_stats_period_s": 0.5},
        "observability": {"traces": "none", "log_level": "WARNING"}}
    if num_prefill is not None:
        if not 0 < num_prefill < args.num_replicas:
            raise ValueError(f"a P/D split needs 1..{args.num_replicas - 1} prefill replicas, got {num_prefill}")
        cfg["disaggregation"] = {
            "enabled": True, "min_remote_prefill_tokens": 256, "transfer_timeout_s": wall_timeout_s,
            "local_prefill_slack_s": local_prefill_slack_s,
            "prefill": {"num_replicas": num_prefill,
                        "engine": {"scheduler": {"max_num_batched_tokens": args.prefill_budget}}},
            "decode": {"num_replicas": args.num_replicas - num_prefill}}
    return cfg


def start_cluster() -> str:
    """Ray + Serve on 127.0.0.1 (a free port); returns the app's base URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}{ROUTE}"


def _wait_running(deployment: str, n: int, timeout_s: float = 180) -> None:
    wait_running(APP, deployment, n, timeout_s)


def deploy(cfg: dict[str, Any]) -> None:
    from ray import serve

    from affinity_serve.app.builder import build_app
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    d = cfg.get("disaggregation")
    if d:
        _wait_running("PrefillReplica", d["prefill"]["num_replicas"])
        _wait_running("LLMReplica", d["decode"]["num_replicas"])
    else:
        _wait_running("LLMReplica", cfg["serve"]["num_replicas"])


def replica_states(deployment: str, n: int, max_calls: int = 200) -> list[dict[str, Any]]:
    """Every replica's `debug_state` (a handle call lands on one replica: call until each answered)."""
    from ray import serve
    h = serve.get_deployment_handle(deployment, APP)
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(max_calls):
        st = h.debug_state.remote().result(timeout_s=30)
        seen[st["replica_id"]] = st
        if len(seen) == n:
            break
    return list(seen.values())


# ---------------------------------------------------------------- the client
def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


async def _one(client: Any, url: str, prompt: list[int], res: Result, t0: float, timeout_s: float) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, res.max_tokens),
                                 timeout=timeout_s) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:200]
                res.replica = res.replica or chunk.get("system_fingerprint")
                now = time.monotonic() - t0
                for choice in chunk.get("choices") or ():
                    res.token_times.extend([now] * len(choice.get("token_ids") or ()))
        if res.error is None and len(res.token_times) != res.max_tokens:
            res.error = f"incomplete: {len(res.token_times)} of {res.max_tokens} tokens"
    except Exception as e:          # a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        res.end_s = time.monotonic() - t0


async def replay(url: str, trace: list[tuple[float, list[int]]], max_tokens: int, timeout_s: float) -> list[Result]:
    """Send each request at its arrival time (open loop), all streamed; wait for every one."""
    import httpx
    results = [Result(f"r{i}", at, max_tokens) for i, (at, _) in enumerate(trace)]
    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic()
        tasks = []
        for res, (at, prompt) in zip(results, trace):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, url, prompt, res, t0, timeout_s)))
        await asyncio.gather(*tasks)
    return results


async def unloaded(url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[Result]:
    """One request at a time: the path's own cost with nothing else in flight (also warms every process)."""
    import httpx
    out = []
    async with httpx.AsyncClient() as client:
        for i, prompt in enumerate(prompts):
            t0 = time.monotonic()
            res = Result(f"w{i}", 0.0, max_tokens)
            await _one(client, url, prompt, res, t0, timeout_s)
            out.append(res)
    return out


# ---------------------------------------------------------------- summaries
def summarize(name: str, results: list[Result], k: float) -> dict[str, Any]:
    """Device-time (wall / k) latencies of the completed requests; output tokens per device second."""
    ok = [r for r in results if r.ok]
    ttft = [(r.token_times[0] - r.arrival_s) / k for r in ok]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) / k for r in ok]
    gaps = [(b - a) / k for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    span = (max(r.end_s for r in ok) - min(r.arrival_s for r in ok)) / k if ok else float("nan")
    return {"config": name, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99), "gap_p99_s": _pct(gaps, 99),
            "throughput_tok_s": sum(len(r.token_times) for r in ok) / span if ok else 0.0,
            "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "replicas_serving": len({r.replica for r in ok if r.replica}),
            "_tpot_series": [(r.token_times[0] / k, t) for r, t in zip(ok, tpot)]}


def unloaded_row(results: list[Result]) -> dict[str, Any]:
    """Wall milliseconds of the unloaded requests: TTFT and TPOT medians."""
    ok = [r for r in results if r.ok]
    return {"ttft_wall_ms": _pct([r.token_times[0] * 1e3 for r in ok], 50),
            "tpot_wall_ms": _pct([(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) * 1e3
                                  for r in ok], 50), "completed": len(ok), "failed": len(results) - len(ok)}


COUNTERS = ("kv_reads", "kv_read_failures", "kv_read_bytes", "remote_prefills", "prefill_failed", "local_backlog")


def pool_counters(num_prefill: int | None, num_replicas: int) -> dict[str, Any]:
    """After a run: KV transfers and fallbacks on the decode pool, and blocks still held in either pool."""
    decode = replica_states("LLMReplica", num_replicas - (num_prefill or 0))
    pools = decode + (replica_states("PrefillReplica", num_prefill) if num_prefill else [])
    out: dict[str, Any] = {"leaked_blocks": sum(s["num_blocks"] - 1 - s["num_free_blocks"] for s in pools),
                           "requests_left": sum(s["num_requests"] for s in pools)}
    if num_prefill:
        kv = [s["kv_connector"] or {} for s in decode]
        out |= {"kv_reads": sum(c.get("loads_ok", 0) for c in kv),
                "kv_read_failures": sum(c.get("loads_failed", 0) for c in kv),
                "kv_read_bytes": sum(c.get("loaded_bytes", 0) for c in kv),
                "remote_prefills": sum(s["disaggregation"]["remote"] for s in decode),
                "prefill_failed": sum(s["disaggregation"]["prefill_failed"] for s in decode),
                "local_backlog": sum(s["disaggregation"].get("local_backlog", 0) for s in decode)}
    return out


def trace(args: argparse.Namespace, seed: int) -> list[tuple[float, list[int]]]:
    """Poisson arrivals at `wall_rate`, prompts uniform in [min_prompt, max_prompt] (benchmarks.disagg's trace:
    the same seed and rate give the same requests)."""
    return _trace(args, seed)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-replicas", type=int, default=4)
    ap.add_argument("--splits", default="2", help="prefill replica counts to try (the rest decode)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=6.5, help="requests per second of the modelled device (the "
                    "trace arrives at rate / --time-dilation of wall time)")
    ap.add_argument("--min-prompt", type=int, default=2048)
    ap.add_argument("--max-prompt", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=2048, help="unified and decode replicas' max_num_batched_tokens")
    ap.add_argument("--prefill-budget", type=int, default=8192)
    ap.add_argument("--device-profile", choices=sorted(PROFILES), default="h100-llama8b")
    ap.add_argument("--time-dilation", type=float, default=10.0)
    ap.add_argument("--num-blocks", type=int, default=4200)
    ap.add_argument("--unloaded", type=int, default=2, help="requests sent one at a time before each trace")
    ap.add_argument("--local-prefill-slacks", default="",
                    help="comma list of disaggregation.local_prefill_slack_s values (wall seconds): each split runs "
                         "again once per value (conditional disaggregation); default: off only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    try:
        slacks = [float(x) for x in args.local_prefill_slacks.split(",") if x]
    except ValueError:
        ap.error(f"--local-prefill-slacks takes seconds separated by commas, got {args.local_prefill_slacks!r}")
    if any(x < 0 for x in slacks):
        ap.error(f"--local-prefill-slacks must be >= 0, got {args.local_prefill_slacks!r}")
    if args.time_dilation < 1:
        ap.error(f"--time-dilation must be >= 1 (a slower copy of the device), got {args.time_dilation}")
    c = paced_costs(PROFILES[args.device_profile], (args.min_prompt + args.max_prompt) / 2, args.time_dilation)
    args.step_base_s, args.prefill_per_token_s = c.step_base_s, c.prefill_per_token_s
    args.decode_per_context_token_s = c.decode_per_context_token_s
    args.wall_rate = args.rate / args.time_dilation
    return args


def run_config(args: argparse.Namespace, model: str, url: str, num_prefill: int | None,
               local_prefill_slack_s: float | None = None) -> dict[str, Any]:
    """Deploy one configuration, send the unloaded requests and the trace, summarize, delete the app."""
    from ray import serve
    k = args.time_dilation
    n = args.num_replicas
    name = f"unified x{n}" if num_prefill is None else f"P/D {num_prefill}:{n - num_prefill}"
    if local_prefill_slack_s is not None:
        name += f" slack {local_prefill_slack_s:g}"
    t = time.monotonic()
    deploy(app_config(args, model, num_prefill, local_prefill_slack_s))
    print(f"[{name}] deployed in {time.monotonic() - t:.0f} s", flush=True)
    try:
        rng = random.Random(10_000 + args.seed)
        warm = [[rng.randrange(10, 700) for _ in range((args.min_prompt + args.max_prompt) // 2)]
                for _ in range(args.unloaded)]
        timeout_s = 120.0 * k / 10 + args.max_tokens * args.step_base_s * 20
        idle = unloaded_row(asyncio.run(unloaded(url, warm, args.max_tokens, timeout_s)))
        before = pool_counters(num_prefill, args.num_replicas)
        t = time.monotonic()
        results = asyncio.run(replay(url, trace(args, args.seed), args.max_tokens, timeout_s))
        print(f"[{name}] trace done in {time.monotonic() - t:.0f} s", flush=True)
        after = pool_counters(num_prefill, args.num_replicas)
        counted = {key: v - before[key] if key in COUNTERS else v for key, v in after.items()}   # the trace's own
        row = summarize(name, results, k) | counted
        row["unloaded"] = idle
        return row
    finally:
        serve.delete(APP)


def table(results: list[dict[str, Any]], base: dict[str, Any]) -> str:
    hdr = (f"{'config':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'gap p99':>8} "
           f"{'tok/s':>7} {'done':>5} {'fail':>5} {'reads':>6} {'fallb':>6} {'leaked':>6} "
           f"{'idle TTFT':>10} {'idle TPOT':>10}  TPOT p99 / TTFT p99 vs {base['config']}")
    lines = [hdr]
    for r in results:
        u = r["unloaded"]
        lines.append(
            f"{r['config']:<12} {r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p99_s'] * 1e3:7.0f}ms "
            f"{r['tpot_p50_s'] * 1e3:7.2f}ms {r['tpot_p99_s'] * 1e3:7.2f}ms {r['gap_p99_s'] * 1e3:6.1f}ms "
            f"{r['throughput_tok_s']:7.0f} {r['completed']:5d} {r['failed']:5d} {r.get('kv_reads', 0):6d} "
            f"{r.get('kv_read_failures', 0) + r.get('prefill_failed', 0):6d} {r['leaked_blocks']:6d} "
            f"{u['ttft_wall_ms']:8.0f}ms {u['tpot_wall_ms']:8.1f}ms  "
            f"{r['tpot_p99_s'] / base['tpot_p99_s']:.2f}x / {r['ttft_p99_s'] / base['ttft_p99_s']:.2f}x")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, k: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        xs, ys = zip(*sorted(r["_tpot_series"])) if r["_tpot_series"] else ((), ())
        ax.plot(xs, [y * 1e3 for y in ys], marker=".", linestyle="-", label=r["config"])
    ax.set_xlabel(f"first token at (s of device time, wall / {k:g})")
    ax.set_ylabel("TPOT of the request (device ms)")
    ax.set_title("Ray Serve, replicas paced to an emulated device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from affinity_serve.engine.demo import write_demo_model
    from benchmarks.routing.real import stop_cluster
    model = tempfile.mkdtemp(prefix="disagg-serve-bench-")
    write_demo_model(model, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=args.max_prompt + args.max_tokens + 64, seed=1)
    k = args.time_dilation
    mean_prompt = (args.min_prompt + args.max_prompt) / 2
    load = args.rate * mean_prompt * args.prefill_per_token_s / k / args.num_replicas
    url = start_cluster()
    results = []
    try:
        for num_prefill in [None, *(int(x) for x in args.splits.split(",") if x)]:
            results.append(run_config(args, model, url, num_prefill))
            for slack in (float(x) for x in args.local_prefill_slacks.split(",") if x and num_prefill):
                results.append(run_config(args, model, url, num_prefill, slack))
    finally:
        stop_cluster()
    base = results[0]
    print(f"\n{args.num_requests} requests at {args.rate}/s of device time ({args.wall_rate:.3g}/s wall), prompts "
          f"{args.min_prompt}-{args.max_prompt}, {args.max_tokens} output tokens, {args.device_profile} dilated "
          f"{k:g}x (bare step {args.step_base_s / k * 1e3:.2f} device ms); prefill load per unified replica "
          f"{load:.2f}. Device time (wall / {k:g}) except the unloaded ('idle') columns: wall time.")
    print(table(results, base))
    for r in results:
        if r.get("local_backlog"):
            print(f"{r['config']}: {r['local_backlog']} requests prefilled on a decode replica "
                  f"(conditional disaggregation)")
    checks = verdicts(results)
    for v in checks:
        print(f"target vs {v['unified']}: {v['pd']} TPOT p99 {v['tpot_p99_ratio']:.2f}x, TTFT p99 "
              f"{v['ttft_p99_ratio']:.2f}x -> {'met' if v['met'] else 'missed'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "time_dilation": k, "prefill_load_per_unified_replica": load,
                       "note": "latencies in device seconds (wall / time_dilation); 'unloaded' in wall ms",
                       "results": [{key: v for key, v in r.items() if not key.startswith("_")} for r in results],
                       "verdicts": checks}, f, indent=1)
    if args.png:
        plot(results, args.png, k)


if __name__ == "__main__":
    main()
