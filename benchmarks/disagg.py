"""P/D disaggregation against unified serving on emulated devices, and what a KV transfer costs.

Part 1 (scheduling, `engine.pace`): N engines, each in its own thread and paced to a modelled accelerator
(a step lasts step_base_s + prefill_per_token_s x prompt tokens in it + ...), so each adds capacity as a GPU
would and a long prefill in a mixed batch stalls that step's decodes as it does there. The same Poisson trace
of long prompts and long outputs runs on N unified engines (least-loaded dispatch) and on each P:D split of
the same N (prefill on the least-loaded P engine, its KV read by the least-loaded D engine through the
LocalTransport). Reported: TTFT p50/p99, TPOT p50/p99 (per request), the p99 gap between two tokens of a
stream, throughput, prefix hit rate, failures and fallbacks; a PNG of per-request TPOT over time.
`--spill-tokens` runs each split again with conditional disaggregation: a request whose least-loaded prefill
engine has that many prompt tokens waiting is prefilled (and decoded) on a decode engine instead.

Part 2 (transfer cost): gather + scatter of n blocks between two engines' pools through the LocalTransport,
and `ray.put` in one process + `ray.get` in another on the same node (Ray's object store), per block and per
request, for the demo model's layout and for a Llama-3-8B-sized block (32 layers x 8 KV heads x 128 x 16
tokens, bf16: 2 MiB).

`--device-profile h100-llama8b` derives the three pace costs (and the KV transfer's time) from an H100's
public figures and Llama-3.1-8B's shapes (DeviceProfile below), then slows all of them and the arrival rate
by one factor (`--time-dilation`) so that this CPU, which really computes a tiny model's prompts, stays
well inside each modelled step: ratios between configurations are unchanged by the factor.

    flock /tmp/affinity-bench.lock .venv/bin/python -m benchmarks.disagg --json out.json --png tpot.png
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

from affinity_serve.engine import LLM, RemoteDecode, SamplingParams
from affinity_serve.engine.demo import write_demo_model
from affinity_serve.engine.kv_connector import LocalTransport
from affinity_serve.engine.pacing import modelled_step_time_s


@dataclass
class Req:
    rid: str
    prompt: list[int]
    arrival: float
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    done: float | None = None
    failed: bool = False


# ---------------------------------------------------------------- device profiles
@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One GPU serving one model, as public figures; `paced_costs` turns them into engine.pace's costs.

    The step model (engine/pacing.py) is linear: base + prefill tokens x a + decoding context tokens x b.
      base = every weight read once from HBM, at the fraction of peak bandwidth a decode step reaches,
             plus the host/launch time a step pays however small;
      a    = a prompt token's FLOPs (2 x matmul parameters, plus attention QK^T and PV over its causal
             context, taken at the workload's mean) at the fraction of peak dense FLOP/s prefill reaches (MFU);
      b    = one context token's K and V read once per decode step, at the same bandwidth fraction.
    A prefill step is charged base + a x tokens: a compute-bound step hides most of its weight reads, so
    this slightly over-charges mixed steps (the unified side's), never the decode pool's.
    """

    name: str
    hbm_bytes_per_s: float            # spec memory bandwidth
    bandwidth_fraction: float         # reached by a decode step's reads (assumed / measured, see PROFILES)
    dense_bf16_flop_per_s: float      # spec dense bf16 tensor throughput (no sparsity)
    mfu: float                        # fraction of it reached by prefill (assumed)
    step_overhead_s: float            # per step, however small the batch
    link_bytes_per_s: float           # KV transfer between a prefill and a decode GPU
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def matmul_params(self) -> int:
        """Per-token matmul weights of the layers (q, k, v, o and the gated MLP); the LM head runs for one
        token of a prompt, so a prompt token does not pay it."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = d * self.num_heads * self.head_dim * 2 + d * kv * 2
        return self.num_layers * (attn + 3 * d * self.intermediate_size)

    @property
    def weight_bytes(self) -> int:
        """Layers + untied embedding and LM head + RMSNorm weights (Llama-3.1-8B: 8,030,261,248 params)."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return (self.matmul_params + 2 * self.vocab_size * self.hidden_size + norms) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops_per_token(self, mean_attended_tokens: float) -> float:
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * mean_attended_tokens   # QK^T + PV
        return 2 * self.matmul_params + attn


@dataclass(frozen=True, slots=True)
class PacedCosts:
    """engine.pace's three costs plus the KV transfer's time per prompt token, already dilated."""

    step_base_s: float
    prefill_per_token_s: float
    decode_per_context_token_s: float
    transfer_per_token_s: float
    time_dilation: float


def paced_costs(profile: DeviceProfile, mean_prompt_tokens: float, time_dilation: float) -> PacedCosts:
    """The profile's costs for prompts of this mean length (a prompt token attends to half the prompt on
    average, causal), each multiplied by `time_dilation` (>= 1: a slower copy of the same device)."""
    if time_dilation < 1:
        raise ValueError(f"time_dilation must be >= 1 (a slower copy of the device), got {time_dilation}")
    bw = profile.hbm_bytes_per_s * profile.bandwidth_fraction
    flops = profile.dense_bf16_flop_per_s * profile.mfu
    return PacedCosts(
        step_base_s=(profile.weight_bytes / bw + profile.step_overhead_s) * time_dilation,
        prefill_per_token_s=profile.prefill_flops_per_token(mean_prompt_tokens / 2) / flops * time_dilation,
        decode_per_context_token_s=profile.kv_bytes_per_token / bw * time_dilation,
        transfer_per_token_s=profile.kv_bytes_per_token / profile.link_bytes_per_s * time_dilation,
        time_dilation=time_dilation)


PROFILES = {
    # H100 SXM5 80GB: 3.35 TB/s HBM3, 989.4 TFLOP/s dense bf16 (NVIDIA's datasheet). Bandwidth fraction 0.9:
    # this project's H100 run measured a 3002 GB/s device copy (docs/gpu_bench_h100.json), 0.90 of spec.
    # Step overhead 0.58 ms: the same run's batch-1 decode step (1.41 ms) minus its bandwidth floor
    # (0.83 ms). MFU 0.5 for prefill is an assumption (FlashAttention-class kernels on 2-8k-token prompts).
    # Link: one 400 Gb/s RDMA NIC per GPU (ConnectX-7, 50 GB/s) at 0.8 of line rate, the cross-node case
    # (NVLink within a node is faster). Model: Llama-3.1-8B's config.json, bf16.
    "h100-llama8b": DeviceProfile(
        name="h100-llama8b", hbm_bytes_per_s=3.35e12, bandwidth_fraction=0.9, dense_bf16_flop_per_s=989.4e12,
        mfu=0.5, step_overhead_s=0.58e-3, link_bytes_per_s=0.8 * 50e9, num_layers=32, hidden_size=4096,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
}


class Worker(threading.Thread):
    """One emulated device: an engine stepped by its own thread; work arrives through `inbox`."""

    def __init__(self, name, engine, on_delta):
        super().__init__(daemon=True, name=name)
        self.engine, self.on_delta = engine, on_delta
        self.inbox: queue.Queue = queue.Queue()
        self.in_flight = 0
        self.stop = False

    def run(self):
        e = self.engine
        while not self.stop:
            while True:
                try:
                    rid, prompt, params, kv = self.inbox.get_nowait()
                except queue.Empty:
                    break
                e.add_request(e.make_request(prompt, params, kv_transfer=kv, req_id=rid))
            if not e.has_unfinished_requests():
                time.sleep(0.0005)
                continue
            out = e.step()
            for d in out.deltas:
                self.on_delta(self, d)
            if out.stats.num_scheduled_tokens == 0:
                time.sleep(0.0005)    # an idle device (holds or reads only): do not spin the GIL away


class LinkTransport(LocalTransport):
    """The LocalTransport, each read held as long as the modelled link takes to move that many tokens' KV
    (the tiny model's own KV is a few KiB a block, so its copy alone would make the transfer free)."""

    def __init__(self, per_token_s: float, block_size: int):
        super().__init__()
        self.per_block_s = per_token_s * block_size

    def _read(self, remote, start_block, num_blocks):
        time.sleep(num_blocks * self.per_block_s)
        return super()._read(remote, start_block, num_blocks)


class OverrunMeter:
    """Wraps an engine's PacedRunner and counts the steps this CPU made longer than the modelled device
    (1 ms of slack): how far the host's real compute leaked into the emulated timings."""

    def __init__(self, paced):
        self.paced = paced
        self.steps = self.overruns = 0
        self.overrun_s = 0.0

    def __getattr__(self, name):
        return getattr(self.paced, name)

    def execute_model(self, so):
        p = self.paced._pace
        modelled = (modelled_step_time_s(so, self.paced._requests, p.step_base_s, p.prefill_per_token_s,
                                         p.decode_per_context_token_s) if so.num_scheduled_tokens else 0.0)
        t0 = time.perf_counter()
        out = self.paced.execute_model(so)
        over = time.perf_counter() - t0 - modelled
        self.steps += 1
        if over > 1e-3:
            self.overruns += 1
            self.overrun_s += over
        return out


def _engine(model, args, scheduler, transport=None):
    kw = dict(cache={"num_blocks": args.num_blocks, "block_size": 16}, num_threads=1, scheduler=scheduler,
              pace={"enabled": True, "step_base_s": args.step_base_s, "prefill_per_token_s": args.prefill_per_token_s,
                    "decode_per_context_token_s": args.decode_per_context_token_s})
    if transport is not None:
        kw["kv_connector"] = {"type": "pd", "transfer_timeout_s": 30.0, "load_timeout_s": 10.0}
    engine = LLM(model, **kw).engine
    if transport is not None:
        engine.set_kv_transport(transport)
        transport.register(engine.pd.engine_id, engine.kv_source)
    engine.runner = OverrunMeter(engine.runner)
    return engine


def _trace(args, seed):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(args.num_requests):
        t += rng.expovariate(args.wall_rate)
        n = rng.randrange(args.min_prompt, args.max_prompt + 1)
        out.append((t, [rng.randrange(10, 700) for _ in range(n)]))
    return out


def run(model, args, num_prefill: int | None, late_reads: bool = False, budget: int | None = None,
        spill_tokens: int = 0):
    """num_prefill None: unified. `late_reads`: the decode engines start a request's KV read only when they
    admit it (the connector before early reads), not when it arrives. `budget`: the unified (or decode)
    engines' token budget, default --budget. Returns (requests, engines' stats, start time)."""
    lock = threading.Lock()
    reqs: dict[str, Req] = {}
    transport = None
    if num_prefill:
        transport = LinkTransport(args.transfer_per_token_s, 16) if args.transfer_per_token_s else LocalTransport()
    n = args.num_engines
    sched_u = {"max_num_batched_tokens": budget or args.budget, "max_num_seqs": 64}
    sched_p = {"max_num_batched_tokens": args.prefill_budget, "max_num_seqs": 64}
    decodes: list[Worker] = []

    def pick(pool):
        return min(pool, key=lambda w: w.in_flight)

    queued: dict[str, int] = {}          # worker name -> prompt tokens sent to it whose first token has not come
    spilled: dict[str, Worker] = {}      # request id -> the decode worker that prefills it itself
    num_spilled = 0

    def first_token(w, rid):
        if rid in spilled or not w.name.startswith("D"):
            spilled.pop(rid, None)
            queued[w.name] -= len(reqs[rid].prompt)

    def on_unified(w, d):
        r = reqs[d.req_id]
        now = time.monotonic()
        if d.token_ids:
            if not r.token_times:
                with lock:
                    first_token(w, d.req_id)
            r.token_times.extend([now] * len(d.token_ids))
        if d.finished:
            r.failed = d.finish_reason not in ("length", "stop")
            r.done = now
            with lock:
                w.in_flight -= 1

    def on_prefill(w, d):
        r = reqs[d.req_id]
        now = time.monotonic()
        r.token_times.extend([now] * len(d.token_ids))
        if d.finished:
            with lock:
                w.in_flight -= 1
                queued[w.name] -= len(r.prompt)
                target = pick(decodes)
                target.in_flight += 1
            if d.kv_transfer is None:
                r.failed, r.done = True, now
                return
            target.inbox.put((d.req_id, r.prompt, _params(r.max_tokens), [d.kv_transfer]))

    if num_prefill:
        prefills = [Worker(f"P{i}", _engine(model, args, sched_p, transport), on_prefill) for i in range(num_prefill)]
        decodes += [Worker(f"D{i}", _engine(model, args, sched_u, transport), on_unified)
                    for i in range(n - num_prefill)]
        if late_reads:
            for w in decodes:
                w.engine.pd.early_loads = False
        entry = prefills
    else:
        prefills = []
        decodes += [Worker(f"U{i}", _engine(model, args, sched_u), on_unified) for i in range(n)]
        entry = decodes
    workers = prefills + decodes
    for w in workers:
        queued[w.name] = 0
        w.start()
    t0 = time.monotonic()
    for i, (at, prompt) in enumerate(_trace(args, args.seed)):
        wait = t0 + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        r = reqs[f"r{i}"] = Req(f"r{i}", prompt, time.monotonic(), args.max_tokens)
        remote = bool(num_prefill)
        with lock:
            w = pick(entry)
            if remote and spill_tokens and min(queued[x.name] for x in entry) >= spill_tokens:
                # conditional disaggregation: the prefill pool is backed up, prefill on a decode device
                w = min(decodes, key=lambda x: (queued[x.name], x.in_flight))
                spilled[r.rid] = w
                num_spilled += 1
                remote = False
            w.in_flight += 1
            queued[w.name] += len(prompt)
        params = _params(1) if remote else _params(r.max_tokens)
        w.inbox.put((r.rid, prompt, params, RemoteDecode() if remote else None))
    deadline = time.monotonic() + args.drain_s
    while time.monotonic() < deadline and any(r.done is None for r in reqs.values()):
        time.sleep(0.05)
    for w in workers:
        w.stop = True
    for w in workers:
        w.join(timeout=5)
    stats = {"loads_failed": 0, "loads_ok": 0, "hits": 0, "queries": 0, "held_s": 0.0, "holds": 0,
             "read_s": 0.0, "steps": 0, "overruns": 0, "overrun_s": 0.0, "spilled": num_spilled}
    for w in workers:
        e = w.engine
        stats["steps"] += e.runner.steps
        stats["overruns"] += e.runner.overruns
        stats["overrun_s"] += e.runner.overrun_s
        stats["hits"] += e.kv_cache_manager.stats.hits
        stats["queries"] += e.kv_cache_manager.stats.queries
        if e.pd is not None:
            stats["loads_failed"] += e.pd.stats.loads_failed
            stats["loads_ok"] += e.pd.stats.loads_ok
            stats["held_s"] += e.pd.pd_stats.held_seconds_total
            stats["holds"] += e.pd.pd_stats.holds
            stats["read_s"] += e.pd.pd_stats.read_seconds_total
        e.close()
    return list(reqs.values()), stats, t0


def _params(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def summarize(name, reqs, stats, t0):
    ok = [r for r in reqs if r.done is not None and not r.failed and len(r.token_times) == r.max_tokens]
    ttft = [r.token_times[0] - r.arrival for r in ok]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    span = max(r.done for r in ok) - min(r.arrival for r in ok) if ok else float("nan")
    return {"config": name, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99), "gap_p99_s": _pct(gaps, 99),
            "throughput_tok_s": sum(len(r.token_times) for r in ok) / span, "completed": len(ok),
            "failed": len(reqs) - len(ok), "hit_rate": stats["hits"] / max(1, stats["queries"]),
            "kv_reads": stats["loads_ok"], "fallbacks": stats["loads_failed"],
            "mean_hold_s": stats["held_s"] / max(1, stats["holds"]),
            "mean_read_s": stats["read_s"] / max(1, stats["loads_ok"]),
            "spilled": stats.get("spilled", 0), "steps": stats["steps"], "overrun_steps": stats["overruns"],
            "overrun_s": stats["overrun_s"],
            "_tpot_series": [(r.token_times[0] - t0, (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1))
                             for r in ok]}


# ---------------------------------------------------------------- part 2: transfer cost
def transfer_cost(model, nblocks_list, repeats=5):
    """Seconds per request for moving n blocks between two engines (LocalTransport: gather + scatter)."""

    rows = []
    p = LLM(model, cache={"num_blocks": 600, "block_size": 16}, num_threads=1, kv_connector={"type": "pd"}).engine
    d = LLM(model, cache={"num_blocks": 600, "block_size": 16}, num_threads=1, kv_connector={"type": "pd"}).engine
    bb = p.pd.layout.block_bytes
    for nb in nblocks_list:
        times = []
        for k in range(repeats):
            prompt = [random.Random(nb * 100 + k).randrange(10, 700) for _ in range(nb * 16 + 1)]
            p.add_request(p.make_request(prompt, _params(1), kv_transfer=RemoteDecode(), req_id=f"t{nb}-{k}"))
            remote = None
            while remote is None:
                for dd in p.step().deltas:
                    if dd.finished:
                        remote = dd.kv_transfer
            t = time.perf_counter()
            data = p.kv_source.read_held_blocks(remote.transfer_id, 0, remote.num_blocks)
            from affinity_serve.engine.kv_connector.pd import RemoteRead
            w = d._kv_connector_worker
            w._land(RemoteRead(None, list(range(1, nb + 1)), [], remote=remote), data)
            times.append(time.perf_counter() - t)
            p.step()
        best = statistics.median(times)
        rows.append({"path": "local (gather+scatter)", "layout": "demo", "blocks": nb, "block_bytes": bb,
                     "request_s": best, "per_block_us": best / nb * 1e6, "GB_s": nb * bb / best / 1e9})
    p.close()
    d.close()
    return rows


def ray_cost(block_bytes, nblocks_list, label, repeats=3):
    """ray.put in one actor, ray.get in another, same node (what the app's RayObjectTransport does)."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Side:
        def put(self, nb, bb):
            arr = np.ones((nb, bb), dtype=np.uint8)
            t = time.perf_counter()
            ref = ray.put(arr)
            return [ref], time.perf_counter() - t

        def get(self, refs):
            t = time.perf_counter()
            a = ray.get(refs[0])
            x = np.empty_like(a)      # the decode side lands it (host copy standing in for the scatter)
            x[...] = a
            return time.perf_counter() - t

    a, b = Side.remote(), Side.remote()
    rows = []
    for nb in nblocks_list:
        ts = []
        for _ in range(repeats):
            refs, put_s = ray.get(a.put.remote(nb, block_bytes))
            get_s = ray.get(b.get.remote(refs))
            ts.append(put_s + get_s)
            del refs
        s = statistics.median(ts)
        rows.append({"path": "ray object store (put+get)", "layout": label, "blocks": nb, "block_bytes": block_bytes,
                     "request_s": s, "per_block_us": s / nb * 1e6, "GB_s": nb * block_bytes / s / 1e9})
    return rows


def parse_args(argv=None):
    """The benchmark's options, with a device profile's costs filled in (and its dilation applied)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-engines", type=int, default=4)
    ap.add_argument("--splits", default="1,2", help="prefill engine counts to try (the rest decode)")
    ap.add_argument("--late-read-splits", default="",
                    help="prefill engine counts to run again with reads started at admission, not arrival "
                         "(rows 'late': the connector before early reads)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.2,
                    help="requests per second; with --device-profile, per second of the modelled device (the "
                         "trace then arrives at rate / --time-dilation of wall time)")
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=3072)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="unified and decode engines' max_num_batched_tokens")
    ap.add_argument("--unified-budgets", default="",
                    help="comma list: run unified once per token budget (chunked prefill), e.g. 512,1024,2048; "
                         "a budget listed twice runs twice (row '#2': how far unified repeats); default: --budget only")
    ap.add_argument("--prefill-budget", type=int, default=4096)
    ap.add_argument("--spill-tokens", default="",
                    help="comma list: run each split once per value; a request whose least-loaded prefill "
                         "engine has this many prompt tokens queued is prefilled on a decode engine instead "
                         "(conditional disaggregation); 0: never")
    ap.add_argument("--device-profile", choices=sorted(PROFILES),
                    help="derive the pace costs and the KV link's time from a GPU and model (DeviceProfile)")
    ap.add_argument("--time-dilation", type=float, default=None,
                    help="with --device-profile: how many times slower than the device to run (default 10)")
    ap.add_argument("--step-base-s", type=float, default=None, help="default 0.010 (not with --device-profile)")
    ap.add_argument("--prefill-per-token-s", type=float, default=None,
                    help="default 0.0001 (not with --device-profile)")
    ap.add_argument("--decode-per-context-token-s", type=float, default=None,
                    help="default 0 (not with --device-profile)")
    ap.add_argument("--num-blocks", type=int, default=2200)
    ap.add_argument("--drain-s", type=float, default=120.0, help="wall seconds to wait after the last arrival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    try:
        args.spill_list = [int(x) for x in args.spill_tokens.split(",") if x] or [0]
    except ValueError:
        ap.error(f"--spill-tokens takes prompt-token counts separated by commas, got {args.spill_tokens!r}")
    if any(t < 0 for t in args.spill_list):
        ap.error(f"--spill-tokens must be >= 0 (0: never spill), got {args.spill_tokens!r}")
    manual = {"--step-base-s": args.step_base_s, "--prefill-per-token-s": args.prefill_per_token_s,
              "--decode-per-context-token-s": args.decode_per_context_token_s}
    args.transfer_per_token_s = 0.0
    if args.device_profile:
        given = [k for k, v in manual.items() if v is not None]
        if given:
            ap.error(f"--device-profile sets the pace costs: drop {', '.join(given)} (or drop the profile)")
        if args.time_dilation is None:
            args.time_dilation = 10.0
        if args.time_dilation < 1:
            ap.error(f"--time-dilation must be >= 1 (a slower copy of the device), got {args.time_dilation}")
        c = paced_costs(PROFILES[args.device_profile], (args.min_prompt + args.max_prompt) / 2, args.time_dilation)
        args.step_base_s, args.prefill_per_token_s = c.step_base_s, c.prefill_per_token_s
        args.decode_per_context_token_s = c.decode_per_context_token_s
        args.transfer_per_token_s = c.transfer_per_token_s
    else:
        if args.time_dilation not in (None, 1.0):
            ap.error("--time-dilation applies to --device-profile's costs; scale --step-base-s and the others "
                     "yourself, or pick a profile")
        args.time_dilation = 1.0
        args.step_base_s = 0.010 if args.step_base_s is None else args.step_base_s
        args.prefill_per_token_s = 0.0001 if args.prefill_per_token_s is None else args.prefill_per_token_s
        args.decode_per_context_token_s = args.decode_per_context_token_s or 0.0
    args.wall_rate = args.rate / args.time_dilation
    return args


def unified_name(num_engines: int, budgets: list[int], i: int) -> str:
    """The row name of unified run `i` of `budgets` (--unified-budgets); a budget listed again is a repeat
    of the same run, named '#2', '#3' so that rows stay distinct (to see how far unified's numbers move
    between two runs of one trace)."""
    name = f"unified x{num_engines}" + (f" b{budgets[i]}" if len(budgets) > 1 else "")
    nth = budgets[:i + 1].count(budgets[i])
    return name + (f" #{nth}" if nth > 1 else "")


def verdicts(results):
    """Each P/D row against each unified row: the issue's target is TPOT p99 <= 0.6x and TTFT p99 <= 1.2x
    with no failed request; P/D meets it only if it does so against every unified budget tried."""
    unified = [r for r in results if r["config"].startswith("unified")]
    out = []
    for r in results:
        if r in unified:
            continue
        for u in unified:
            tpot, ttft = r["tpot_p99_s"] / u["tpot_p99_s"], r["ttft_p99_s"] / u["ttft_p99_s"]
            out.append({"pd": r["config"], "unified": u["config"], "tpot_p99_ratio": tpot, "ttft_p99_ratio": ttft,
                        "met": tpot <= 0.6 and ttft <= 1.2 and r["failed"] == 0})
    return out


def main():
    args = parse_args()
    model = tempfile.mkdtemp(prefix="disagg-bench-")
    write_demo_model(model, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=8192, seed=1)
    budgets = [int(x) for x in args.unified_budgets.split(",") if x] or [args.budget]
    results = []
    for i, b in enumerate(budgets):
        results.append(summarize(unified_name(args.num_engines, budgets, i), *run(model, args, None, budget=b)))
    for p in (int(x) for x in args.splits.split(",")):
        for t in args.spill_list:
            name = f"P/D {p}:{args.num_engines - p}" + (f" spill {t}" if t else "")
            results.append(summarize(name, *run(model, args, p, spill_tokens=t)))
    for p in (int(x) for x in args.late_read_splits.split(",") if x):
        results.append(summarize(f"P/D {p}:{args.num_engines - p} late", *run(model, args, p, late_reads=True)))
    base = min((r for r in results if r["config"].startswith("unified")), key=lambda r: r["tpot_p99_s"])
    k = args.time_dilation
    mean_prompt = (args.min_prompt + args.max_prompt) / 2
    load = args.rate * mean_prompt * args.prefill_per_token_s / k / args.num_engines
    print(f"\n{args.num_requests} requests at {args.rate}/s, prompts {args.min_prompt}-{args.max_prompt}, "
          f"{args.max_tokens} output tokens; pace: base {args.step_base_s:.4g}s + {args.prefill_per_token_s:.4g}s/"
          f"prompt token + {args.decode_per_context_token_s:.3g}s/context token; prefill load per unified device "
          f"{load:.2f}")
    if k != 1:
        print(f"{args.device_profile} dilated {k:g}x (trace at {args.wall_rate:.3g}/s of wall time, KV link "
              f"{args.transfer_per_token_s * 1e6:.1f} us/token); times below are device time (wall / {k:g}), "
              f"tok/s per device second")
    hdr = (f"{'config':<19} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'gap p99':>8} "
           f"{'tok/s':>7} {'done':>5} {'fail':>5} {'reads':>6} {'fallb':>6} {'hold s':>7} {'read ms':>7} "
           f"{'overrun':>8}  TPOT p99 / TTFT p99 vs {base['config']}")
    print(hdr)
    for r in results:
        print(f"{r['config']:<19} {r['ttft_p50_s'] / k:9.3f} {r['ttft_p99_s'] / k:9.3f} {r['tpot_p50_s'] / k:9.4f} "
              f"{r['tpot_p99_s'] / k:9.4f} {r['gap_p99_s'] / k:8.3f} {r['throughput_tok_s'] * k:7.1f} "
              f"{r['completed']:5d} {r['failed']:5d} {r['kv_reads']:6d} {r['fallbacks']:6d} "
              f"{r['mean_hold_s'] / k:7.4f} {r['mean_read_s'] * 1e3 / k:7.1f} "
              f"{r['overrun_steps'] / max(1, r['steps']):8.1%}  "
              f"{r['tpot_p99_s'] / base['tpot_p99_s']:.2f}x / {r['ttft_p99_s'] / base['ttft_p99_s']:.2f}x")
    for r in results:
        if r.get("spilled"):
            print(f"{r['config']}: {r['spilled']} requests prefilled on a decode engine")
    checks = verdicts(results)
    for v in checks:
        print(f"target vs {v['unified']:<19}: {v['pd']:<12} TPOT p99 {v['tpot_p99_ratio']:.2f}x, TTFT p99 "
              f"{v['ttft_p99_ratio']:.2f}x -> {'met' if v['met'] else 'missed'}")
    costs = transfer_cost(model, [8, 64, 256])
    if not args.skip_ray:
        import ray
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        costs += ray_cost(costs[0]["block_bytes"], [64, 256], "demo")
        costs += ray_cost(2 * 32 * 8 * 16 * 128 * 2, [16, 64], "llama3-8b bf16")
        ray.shutdown()
    print(f"\n{'transfer path':<28} {'layout':<15} {'blocks':>6} {'block B':>9} {'request ms':>10} "
          f"{'us/block':>9} {'GB/s':>6}")
    for c in costs:
        print(f"{c['path']:<28} {c['layout']:<15} {c['blocks']:6d} {c['block_bytes']:9d} {c['request_s'] * 1e3:10.2f} "
              f"{c['per_block_us']:9.1f} {c['GB_s']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            prof = PROFILES.get(args.device_profile)
            json.dump({"args": vars(args), "time_dilation": k,
                       "note": "result times are wall seconds; divide by time_dilation for device time",
                       "profile": None if prof is None else {f: getattr(prof, f) for f in prof.__slots__},
                       "results": [{key: v for key, v in r.items() if not key.startswith("_")} for r in results],
                       "verdicts": checks, "transfer": costs}, f, indent=1)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in results:
            xs, ys = zip(*sorted(r["_tpot_series"])) if r["_tpot_series"] else ((), ())
            ax.plot([x / k for x in xs], [y * 1e3 / k for y in ys], marker=".", linestyle="-", label=r["config"])
        unit = "" if k == 1 else f" of device time, wall / {k:g}"
        ax.set_xlabel(f"first token at (s{unit})")
        ax.set_ylabel(f"TPOT of the request (ms{unit})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
