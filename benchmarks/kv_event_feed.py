"""What pulling every replica's KV events costs a router, at 8 / 32 / 128 replicas.

Runs the real Scheduler + KVCacheManager (no model: sampled tokens are made up) on a multi-tenant workload
under cache pressure (shared system prompts with Zipf popularity, unique tails, 128-token answers), keeps
the KV events the way AsyncLLMEngine does (engine/kv_events.py), and measures per processed token: events,
block hashes, and the pickled bytes of the `KVEventsReply` a router pulls every `--period-s` (what Ray
carries), plus the router-side unpickle time. Baseline in the same run: the same replies with the
BlockStored token ids stripped (what a hash-only wire format would save). Then scales to a replica
processing `--tokens-per-s` (prefill + decode) and to 8 / 32 / 128 replicas per router, and sizes a
snapshot. `--ray` also times one actor call returning a reply (starts a local Ray: ~10 s).

    python -m benchmarks.kv_event_feed [--tokens-per-s 5000] [--period-s 0.1] [--ray] [--json out.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import time
from dataclasses import replace
from pathlib import Path

from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_events import KVEventLog
from affinity_serve.engine.request import Request
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.types import BlockStored, KVCacheSnapshot, ModelRunnerOutput

BLOCK = 16
REPLICA_COUNTS = (8, 32, 128)


def simulate(steps: int, num_blocks: int, seed: int = 0) -> tuple[list[tuple[int, list]], int]:
    """[(tokens processed so far, events of that step)], and the total tokens processed."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, 4096, enable_kv_cache_events=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64), kv, 4096)
    systems = [[rng.randrange(1000, 32000) for _ in range(512)] for _ in range(50)]
    weights = [1 / (i + 1) for i in range(50)]          # Zipf(1) popularity
    n, processed, out = 0, 0, []
    for _ in range(steps):
        while len(s.requests) < 96:                     # keep a queue: steady prefill + decode
            prompt = rng.choices(systems, weights)[0] + [rng.randrange(1000, 32000) for _ in range(256)]
            s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=128, ignore_eos=True),
                                  block_size=BLOCK))
            n += 1
        so = s.schedule()
        processed += so.total_num_scheduled_tokens
        sampled = [[rng.randrange(1000, 32000)] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens
                   else [] for r in so.num_scheduled_tokens]
        s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
        out.append((processed, kv.take_events()))
    return out, processed


def pulls(steps: list[tuple[int, list]], tokens_per_pull: int) -> list[list]:
    """The events one pull returns when a pull happens every `tokens_per_pull` processed tokens."""
    batches, cur, mark = [], [], tokens_per_pull
    for processed, events in steps:
        cur += events
        if processed >= mark:
            batches.append(cur)
            cur, mark = [], mark + tokens_per_pull
    return batches


def measure(batches: list[list], strip_tokens: bool) -> dict:
    log = KVEventLog("boot:0", 10**9)
    num_bytes = num_events = num_hashes = 0
    t_load = 0.0
    for events in batches:
        if strip_tokens:
            events = [replace(e, token_ids=[]) if isinstance(e, BlockStored) else e for e in events]
        seq = log.next_seq
        log.append("boot:0", events)
        blob = pickle.dumps(log.since(seq, "boot:0"), protocol=5)
        t0 = time.perf_counter()
        pickle.loads(blob)
        t_load += time.perf_counter() - t0
        num_bytes += len(blob)
        num_events += len(events)
        num_hashes += sum(len(getattr(e, "block_hashes", ())) for e in events)
    return {"bytes": num_bytes, "events": num_events, "hashes": num_hashes, "unpickle_s": t_load,
            "pulls": len(batches)}


def time_ray_call(reply) -> float:
    """The caller's CPU seconds per actor call returning `reply` (1000 calls in flight together)."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Feed:
        def since(self, _seq):
            return reply

    a = Feed.remote()
    ray.get(a.since.remote(0))
    t0 = time.process_time()       # the caller's CPU (its Ray core-worker threads included), not the wait
    ray.get([a.since.remote(0) for _ in range(1000)])
    dt = (time.process_time() - t0) / 1000
    ray.shutdown()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-s", type=float, default=5000.0,
                    help="prefill + decode tokens one replica processes per second")
    ap.add_argument("--period-s", type=float, default=0.1, help="how often a router pulls each replica")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV pool per replica (pressure)")
    ap.add_argument("--ray", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()

    steps, processed = simulate(args.steps, args.num_blocks)
    steps = steps[len(steps) // 5:]                      # skip the cold start: steady state only
    start = steps[0][0]
    steps = [(p - start, ev) for p, ev in steps]
    processed -= start
    tokens_per_pull = max(1, int(args.tokens_per_s * args.period_s))
    batches = pulls(steps, tokens_per_pull)
    full, bare = measure(batches, False), measure(batches, True)
    pulls_per_s = 1 / args.period_s
    result = {"tokens_processed": processed, "tokens_per_s": args.tokens_per_s, "period_s": args.period_s,
              "events_per_1k_tokens": 1000 * full["events"] / processed,
              "hashes_per_1k_tokens": 1000 * full["hashes"] / processed}
    print(f"steady state: {processed} tokens processed; per 1k tokens {result['events_per_1k_tokens']:.1f} "
          f"events carrying {result['hashes_per_1k_tokens']:.1f} block hashes")
    print(f"one replica at {args.tokens_per_s:g} tok/s, pulled every {args.period_s:g} s "
          f"({tokens_per_pull} tokens per pull)\n")
    print(f"{'format':<22}{'B/event':>9}{'B/hash':>8}{'B/pull':>9}{'unpickle us/pull':>18}")
    rows = {}
    for name, m in (("events (as sent)", full), ("token ids stripped", bare)):
        row = {"bytes_per_event": m["bytes"] / m["events"], "bytes_per_hash": m["bytes"] / m["hashes"],
               "bytes_per_pull": m["bytes"] / m["pulls"], "unpickle_us_per_pull": 1e6 * m["unpickle_s"] / m["pulls"]}
        rows[name] = row
        print(f"{name:<22}{row['bytes_per_event']:>9.0f}{row['bytes_per_hash']:>8.0f}{row['bytes_per_pull']:>9.0f}"
              f"{row['unpickle_us_per_pull']:>18.1f}")
    ray_call_s = None
    if args.ray:
        ray_call_s = time_ray_call(pickle.loads(pickle.dumps(KVEventLog("b:0", 10).since(0, "b:0"))))
        print(f"\none Ray actor call (empty reply): {1e6 * ray_call_s:.0f} us of the caller's CPU")
    print(f"\nper router (it pulls every replica every {args.period_s:g} s):")
    print(f"{'replicas':>9}{'pulls/s':>9}{'events/s':>10}{'KiB/s':>9}{'unpickle CPU %':>16}"
          + ("{:>14}".format("call CPU %") if ray_call_s else ""))
    scale = []
    per = rows["events (as sent)"]
    for r in REPLICA_COUNTS:
        row = {"replicas": r, "pulls_per_s": r * pulls_per_s,
               "events_per_s": r * args.tokens_per_s * result["events_per_1k_tokens"] / 1000,
               "kib_per_s": r * pulls_per_s * per["bytes_per_pull"] / 1024,
               "unpickle_cpu_pct": 100 * r * pulls_per_s * per["unpickle_us_per_pull"] / 1e6}
        line = (f"{r:>9}{row['pulls_per_s']:>9.0f}{row['events_per_s']:>10.0f}{row['kib_per_s']:>9.0f}"
                f"{row['unpickle_cpu_pct']:>16.2f}")
        if ray_call_s:
            row["call_cpu_pct"] = 100 * r * pulls_per_s * ray_call_s
            line += f"{row['call_cpu_pct']:>14.1f}"
        scale.append(row)
        print(line)
    snap = KVCacheSnapshot("b:0", 0, [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(100_000)])
    snap_bytes = len(pickle.dumps(snap, protocol=5))
    print(f"\na snapshot of 100k cached blocks (1.6M tokens at 16 per block): {snap_bytes / 2**20:.1f} MiB "
          f"({snap_bytes / 100_000:.0f} B/block); taken only on a gap, restart or reset")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "formats": rows, "per_router": scale,
                                               "ray_call_s": ray_call_s, "snapshot_bytes_100k": snap_bytes},
                                              indent=2))


if __name__ == "__main__":
    main()
