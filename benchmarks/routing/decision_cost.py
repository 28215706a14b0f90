"""Decision cost and index memory of the routing core at fleet scale, beside the llm-d-style precise scorer
(benchmarks/routing/field.py) on the same index and the same requests.

Each replica's pool holds `--blocks-per-replica` blocks (default 24,000: an 8B model on an 80 GB GPU holds
~25k blocks of 16 tokens), filled from KV events with prefix groups whose lengths have a long tail (64 to
2,048 blocks: 1k-32k tokens). Requests pick a Zipf-popular group and add 1-64 fresh blocks; a tenth are new
prompts of up to 2,048 blocks. Stats are refreshed every 50 requests per replica; every request gets its
first token and finish, so in-flight load stays bounded. Decision time is this thread's CPU time around
`route()` (other processes on a shared machine cannot inflate it). Index memory is the process's resident
set growth while the events are applied, divided by the hashes held, plus the 65-byte hash object each
entry keeps alive (built beforehand here; in a router they arrive with the events).

    python -m benchmarks.routing.decision_cost                        # 8, 32, 128 replicas
    python -m benchmarks.routing.decision_cost --replicas 128 --json out.json
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, PrefixAffinityRouterCore,
                                        ReplicaInfo, ReplicaLoadView, RouteRequest)
from benchmarks.routing.field import LlmdPrecise
from benchmarks.routing.replica import ReplicaSpec
from benchmarks.routing.routers import ClusterView, SimRequest
from affinity_serve.engine.types import BlockStored

BS = 16
HASH_OBJECT_BYTES = 65          # a 32-byte bytes object: 33 bytes of header + 32 of digest
MAX_QUEUE_WAIT_S = 30.0         # serve.max_queue_wait_s's default: admission's bound


def _chain(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _group_len(rng: random.Random) -> int:
    return int(min(2048, max(64, rng.lognormvariate(5.5, 1.0))))       # median ~245 blocks (~4k tokens)


def build_fleet(num_replicas: int, blocks_per_replica: int, seed: int):
    """Prefix groups and, per replica, the groups its pool holds (filled to about blocks_per_replica)."""
    rng = random.Random(seed)
    groups: list[list[bytes]] = []
    held: list[list[int]] = []
    for r in range(num_replicas):
        mine, total = [], 0
        while total < blocks_per_replica:
            if groups and rng.random() < 0.3:                   # a group another replica holds too
                g = rng.randrange(len(groups))
            else:
                groups.append(_chain(f"g{len(groups)}", _group_len(rng)))
                g = len(groups) - 1
            mine.append(g)
            total += len(groups[g])
        held.append(mine)
    return groups, held


def run(num_replicas: int, blocks_per_replica: int, num_requests: int, seed: int = 0, say=print) -> dict:
    t0 = time.perf_counter()
    groups, held = build_fleet(num_replicas, blocks_per_replica, seed)
    say(f"  {num_replicas} replicas: {len(groups)} prefix groups built in {time.perf_counter() - t0:.1f} s")
    ids = [f"r{i}" for i in range(num_replicas)]
    clock = [0.0]
    core = PrefixAffinityRouterCore(AffinityConfig(), BS, clock=lambda: clock[0], rng=random.Random(seed))
    core.set_replicas([ReplicaInfo(r, f"n{i // 8}") for i, r in enumerate(ids)])
    for rid in ids:
        core.on_stats(rid, ReplicaLoadView(num_blocks=blocks_per_replica))
    gc.collect()
    rss0 = _rss_bytes()
    for rid, mine in zip(ids, held):
        blocks = [b for g in mine for b in groups[g]]
        core.on_kv_events(KVEventBatch(rid, "e", 0, [BlockStored(blocks, None, [], BS)]))
    gc.collect()
    entries = core.index.num_entries
    per_entry = (_rss_bytes() - rss0) / max(1, entries) + HASH_OBJECT_BYTES
    say(f"  index: {entries:,} hashes ({sum(len(st.held) for st in core.index._replicas.values()):,} holdings), "
        f"{per_entry:.0f} B per hash (resident set growth), {core.index.num_evictions} evictions")
    # the llm-d-style scorer over its own index of the same pools
    spec = ReplicaSpec(num_kv_tokens=blocks_per_replica * BS)
    llmd = LlmdPrecise(spec, 20_000.0)
    llmd.setup(ClusterView(num_replicas), seed)
    for k, (rid, mine) in enumerate(zip(llmd.ids, held)):
        llmd.index.apply_events(KVEventBatch(rid, "e", 0, [BlockStored([b for g in mine for b in groups[g]],
                                                                         None, [], BS)]))
    rng = random.Random(seed + 1)
    weights = [1.0 / (k + 1) ** 0.8 for k in range(len(groups))]
    ours_cpu, admit_cpu, near_cpu, llmd_cpu, lengths = [], [], [], [], []
    for n in range(num_requests):
        clock[0] += 0.002
        if n % 50 == 0:
            for rid in ids:
                core.on_stats(rid, ReplicaLoadView(num_running=rng.randrange(0, 64), num_blocks=blocks_per_replica,
                                                   num_queued_prefill_tokens=rng.randrange(0, 40_000),
                                                   kv_cache_usage=rng.random()))
        if rng.random() < 0.1:
            hashes = _chain(f"new{n}", _group_len(rng))
        else:
            hashes = groups[rng.choices(range(len(groups)), weights)[0]] + _chain(f"q{n}", rng.randrange(1, 65))
        hashes = hashes[:2048]
        tokens = len(hashes) * BS + 7
        lengths.append(tokens)
        request = RouteRequest(f"req{n}", hashes, tokens, 256)
        # the ingress's admission control (serve.max_queue_wait_s, on by default) asks the router for the
        # request's predicted wait and holds its load until it is routed: timed apart from the decision. Far
        # from the bound (as here) it skips the prefix match; near it, it matches: every other request is
        # admitted as if near it (no bound), timed apart ("near its bound")
        near = n % 2 == 1
        c0 = time.thread_time()
        core.predict_wait(request, ids, None if near else MAX_QUEUE_WAIT_S)
        core.hold_admitted(request.req_id)
        c1 = time.thread_time()
        d = core.route(request, ids)
        ours_cpu.append(time.thread_time() - c1)
        (near_cpu if near else admit_cpu).append((c1 - c0, ours_cpu[-1]))
        core.on_first_token(d.req_id, 0)
        core.on_finished(d.req_id, 200)
        sim = SimRequest(f"req{n}", [0] * tokens, hashes, 256, "")
        c0 = time.thread_time()
        k = llmd.route(sim, clock[0])
        llmd_cpu.append(time.thread_time() - c0)
        llmd.on_first_token(f"req{n}", k, 0, clock[0])

    def pct(xs, q):
        s = sorted(xs)
        return s[int(q * (len(s) - 1))] * 1e3

    long = [c for c, t in zip(ours_cpu, lengths) if t >= 16_000]
    return {"replicas": num_replicas, "blocks_per_replica": blocks_per_replica, "index_hashes": entries,
            "bytes_per_hash": round(per_entry), "index_mb": round(per_entry * entries / 2**20),
            "requests": num_requests, "prompt_tokens_p50": statistics.median(lengths),
            "prompt_tokens_max": max(lengths),
            "ours_cpu_ms": {"p50": pct(ours_cpu, 0.5), "p99": pct(ours_cpu, 0.99), "max": pct(ours_cpu, 1.0)},
            "ours_cpu_ms_prompts_16k_plus": {"n": len(long), "p99": pct(long, 0.99) if long else None},
            "admission_cpu_ms": {"p50": pct([a for a, _ in admit_cpu], 0.5),
                                 "p99": pct([a for a, _ in admit_cpu], 0.99)},
            "ours_with_admission_cpu_ms": {"p50": pct([a + b for a, b in admit_cpu], 0.5),
                                           "p99": pct([a + b for a, b in admit_cpu], 0.99)},
            "admissions_unmatched": core.num_admissions_unmatched,
            "ours_with_admission_near_bound_cpu_ms": {"p50": pct([a + b for a, b in near_cpu], 0.5),
                                                      "p99": pct([a + b for a, b in near_cpu], 0.99)},
            "llmd_cpu_ms": {"p50": pct(llmd_cpu, 0.5), "p99": pct(llmd_cpu, 0.99), "max": pct(llmd_cpu, 1.0)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="8,32,128", help="comma-separated fleet sizes")
    p.add_argument("--blocks-per-replica", type=int, default=24_000)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    rows = []
    for n in map(int, a.replicas.split(",")):
        print(f"[{n} replicas]", file=sys.stderr, flush=True)
        rows.append(run(n, a.blocks_per_replica, a.requests, say=lambda m: print(m, file=sys.stderr, flush=True)))
    print("| replicas | index hashes | bytes/hash | index MB | ours p50 ms | ours p99 ms | ours p99, prompts >= 16k "
          "| with admission p50 / p99 ms | admission near its bound: p50 / p99 ms "
          "| llm-d-style p50 ms | llm-d-style p99 ms | p99 ours / llm-d |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, lm, lg = r["ours_cpu_ms"], r["llmd_cpu_ms"], r["ours_cpu_ms_prompts_16k_plus"]
        w, nb = r["ours_with_admission_cpu_ms"], r["ours_with_admission_near_bound_cpu_ms"]
        lg_s = f"{lg['p99']:.3f}" if lg["p99"] is not None else "-"
        print(f"| {r['replicas']} | {r['index_hashes']:,} | {r['bytes_per_hash']} | {r['index_mb']} | {o['p50']:.3f} | "
              f"{o['p99']:.3f} | {lg_s} | {w['p50']:.3f} / {w['p99']:.3f} | {nb['p50']:.3f} / {nb['p99']:.3f} | "
              f"{lm['p50']:.3f} | {lm['p99']:.3f} | "
              f"{o['p99'] / lm['p99']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
