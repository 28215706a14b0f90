"""Cost of one scheduler step (schedule() + update_from_output()) at 64 / 256 / 1024 running requests.

Baseline in the same run: a bare Python loop that does the irreducible per-request work of a step
(append one token to each request and build the step's id -> count dict). The ratio says how much our
bookkeeping (block allocation, block hashing, stop checks, stats) costs on top of that.

    python benchmarks/scheduler_step.py [--steps 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import SchedulerConfig  # noqa: E402
from engine.hashing import hash_block_tokens  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.types import ModelRunnerOutput  # noqa: E402

BLOCK = 16


def build(num_reqs: int, prompt_len: int, prefill_reqs: int = 0) -> Scheduler:
    max_len = 8192
    kv = KVCacheManager(num_reqs * 40 + prefill_reqs * 40 + 16, BLOCK, max_len)
    budget = num_reqs + prefill_reqs * 256 + 4096
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_reqs + prefill_reqs + 1),
                  kv, max_len)
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


def time_steps(s: Scheduler, steps: int, add_prefill_every: int = 0) -> list[float]:
    out = []
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    for k in range(steps):
        if add_prefill_every and k % add_prefill_every == 0:
            s.add_request(Request(f"p{k}", [(k * 7 + j) % 30000 + 3 for j in range(256)], params,
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


def stats_ms(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.fmean(xs) * 1e3, xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    cases = [("decode", 64, 0), ("decode", 256, 0), ("decode", 1024, 0), ("mixed", 256, 4)]
    for kind, n, every in cases:
        print(f"[scheduler_step] {kind} {n} requests: warming up ...", flush=True)
        s = build(n, 100)
        time_steps(s, 20, every)
        ours = time_steps(s, args.steps, every)
        base = baseline(n, args.steps)
        m, p99 = stats_ms(ours)
        bm, _ = stats_ms(base)
        rows.append({"case": f"{kind} x{n}" + (" + 256-tok prefill every 4 steps" if every else ""),
                     "mean_ms": round(m, 4), "p99_ms": round(p99, 4), "us_per_req": round(m * 1e3 / n, 2),
                     "baseline_mean_ms": round(bm, 4), "ratio_vs_baseline": round(m / bm, 2)})
    t0 = time.perf_counter()
    for i in range(20000):
        hash_block_tokens(None, list(range(i, i + BLOCK)))
    hash_us = (time.perf_counter() - t0) / 20000 * 1e6
    hdr = f"{'case':<48} {'mean ms':>9} {'p99 ms':>9} {'us/req':>8} {'bare loop ms':>13} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<48} {r['mean_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['us_per_req']:>8.2f} "
              f"{r['baseline_mean_ms']:>13.3f} {r['ratio_vs_baseline']:>6.1f}")
    print(f"block hash (sha256, {BLOCK} tokens): {hash_us:.2f} us per block")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "block_hash_us": hash_us}, indent=2))


if __name__ == "__main__":
    main()
