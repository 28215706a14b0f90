"""Cost and tail latency of one scheduler step (schedule() + update_from_output()) at 64 / 256 / 1024 running.

Two baselines in the same run:
- `gc`: each case runs with CPython's default garbage-collector settings ("default", what the engine
  had before) and with the engine's serving settings ("tuned": engine.gc_policy.tune_gc_for_serving
  applied once the scheduler is built, before any request arrives, as LLMEngine.__init__ does). The
  two alternate over `--repeats` rounds so machine noise hits both alike; percentiles pool the rounds.
- `bare loop`: the irreducible per-request work of a step (append one token to each request, build the
  step's id -> count dict); the ratio says what our bookkeeping costs on top of it.

    python -m benchmarks.scheduler_step [--steps 300] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.gc_policy import tune_gc_for_serving
from affinity_serve.engine.hashing import hash_block_tokens
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.request import Request
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.types import ModelRunnerOutput

BLOCK = 16
CASES = [("decode", 64, 0), ("decode", 256, 0), ("decode", 1024, 0), ("mixed", 256, 4)]
TARGET_P99_OVER_MEAN = 3.0      # at 1024 running, tuned


def reset_gc() -> None:
    """CPython's defaults: nothing frozen, thresholds (700, 10, 10)."""
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    gc.collect()


def build(num_reqs: int, prompt_len: int, mode: str) -> Scheduler:
    max_len = 8192
    kv = KVCacheManager(num_reqs * 40 + 16, BLOCK, max_len)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=num_reqs + 4096, max_num_seqs=num_reqs + 1),
                  kv, max_len)
    if mode == "tuned":
        tune_gc_for_serving()       # a replica does this once its engine is built: requests come later
    params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)
    for i in range(num_reqs):
        s.add_request(Request(f"d{i}", [(i * 31 + j) % 30000 + 3 for j in range(prompt_len)], params,
                              eos_token_id=2, block_size=BLOCK))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in s.requests.values()) or s.waiting:
        so = s.schedule()
        s.update_from_output(so, fake_output(s, so))
    return s


def fake_output(s: Scheduler, so) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    reqs = s.requests
    return ModelRunnerOutput(ids, [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else []
                                   for r in ids])


def time_steps(s: Scheduler, steps: int, add_prefill_every: int = 0, tag: str = "") -> list[float]:
    out = []
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    for k in range(steps):
        if add_prefill_every and k % add_prefill_every == 0:
            s.add_request(Request(f"p{tag}{k}", [(k * 7 + j) % 30000 + 3 for j in range(256)], params,
                                  eos_token_id=2, block_size=BLOCK))
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        runner_out = fake_output(s, so)          # the runner's job: not timed
        t2 = time.perf_counter()
        s.update_from_output(so, runner_out)
        out.append((t1 - t0) + (time.perf_counter() - t2))
    return out


def baseline(num_reqs: int, steps: int) -> list[float]:
    toks = [[0] * 64 for _ in range(num_reqs)]
    ids = [f"d{i}" for i in range(num_reqs)]
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched = {rid: 1 for rid in ids}
        for t in toks:
            t.append(7)
        sampled = [[7] for _ in ids]
        out.append(time.perf_counter() - t0)
        del sched, sampled
    return out


def summary_ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    mean = statistics.fmean(xs) * 1e3
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3
    return {"mean_ms": round(mean, 4), "p50_ms": round(xs[len(xs) // 2] * 1e3, 4), "p99_ms": round(p99, 4),
            "max_ms": round(xs[-1] * 1e3, 4), "p99_over_mean": round(p99 / mean, 2)}


def run_case(kind: str, n: int, every: int, steps: int, repeats: int) -> list[dict]:
    samples: dict[str, list[float]] = {"default": [], "tuned": []}
    collections: dict[str, int] = {"default": 0, "tuned": 0}
    for r in range(repeats):
        for mode in ("default", "tuned"):
            print(f"[scheduler_step] {kind} x{n} gc={mode} round {r + 1}/{repeats} ...", flush=True)
            reset_gc()
            s = build(n, 100, mode)
            time_steps(s, 20, every, tag=f"w{r}{mode}")           # warm-up
            before = sum(st["collections"] for st in gc.get_stats())
            samples[mode] += time_steps(s, steps, every, tag=f"{r}{mode}")
            collections[mode] += sum(st["collections"] for st in gc.get_stats()) - before
            del s
    reset_gc()
    bare = statistics.fmean(baseline(n, steps)) * 1e3
    case = f"{kind} x{n}" + (" + 256-tok prefill every 4 steps" if every else "")
    rows = []
    for mode in ("default", "tuned"):
        st = summary_ms(samples[mode])
        rows.append({"case": case, "gc": mode, **st, "us_per_req": round(st["mean_ms"] * 1e3 / n, 2),
                     "gc_collections": collections[mode], "bare_loop_mean_ms": round(bare, 4),
                     "ratio_vs_bare_loop": round(st["mean_ms"] / bare, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per case, gc mode and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds alternating the two gc modes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [row for kind, n, every in CASES for row in run_case(kind, n, every, args.steps, args.repeats)]
    t0 = time.perf_counter()
    for i in range(20000):
        hash_block_tokens(None, list(range(i, i + BLOCK)))
    hash_us = (time.perf_counter() - t0) / 20000 * 1e6
    hdr = (f"{'case':<44} {'gc':<8} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/mean':>9} {'max ms':>8} "
           f"{'GCs':>5} {'us/req':>7} {'bare ms':>8} {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<44} {r['gc']:<8} {r['mean_ms']:>8.3f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{r['p99_over_mean']:>8.1f}x {r['max_ms']:>8.2f} {r['gc_collections']:>5} {r['us_per_req']:>7.2f} "
              f"{r['bare_loop_mean_ms']:>8.3f} {r['ratio_vs_bare_loop']:>5.1f}x")
    print(f"block hash (sha256, {BLOCK} tokens): {hash_us:.2f} us per block")
    tuned_1024 = next(r for r in rows if r["case"] == "decode x1024" and r["gc"] == "tuned")
    ok = tuned_1024["p99_over_mean"] <= TARGET_P99_OVER_MEAN
    print(f"target p99 <= {TARGET_P99_OVER_MEAN:g}x mean at 1024 running (tuned): "
          f"{tuned_1024['p99_over_mean']:.1f}x -> {'met' if ok else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "block_hash_us": hash_us, "steps": args.steps,
                                         "repeats": args.repeats, "target_met": ok}, indent=2))


if __name__ == "__main__":
    main()
