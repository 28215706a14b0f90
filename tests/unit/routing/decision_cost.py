"""Decision cost of PrefixAffinityRouterCore.route() at 8, 32 and 128 replicas (not a test: a measurement).

    .venv/bin/python -m tests.unit.routing.decision_cost [--requests 5000]

Each replica holds ~40 prefix groups of 64-256 blocks (1k-4k tokens at block size 16) from KV events; each
request is a Zipf-popular group plus 8-64 fresh blocks, with stats refreshed every 50 requests and
first-token/finish notifications so in-flight load stays bounded. Prints route() p50/p99/max in ms, wall
time and this thread's CPU time (the CPU columns leave out time the OS gave to other processes, which
dominates the wall p99 on a shared machine).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, PrefixAffinityRouterCore, ReplicaInfo,
                                        ReplicaLoadView, RouteRequest)
from affinity_serve.engine.types import BlockStored

from .helpers import chain


def run(num_replicas: int, num_requests: int, seed: int = 0) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    clock = [0.0]
    core = PrefixAffinityRouterCore(AffinityConfig(), 16, clock=lambda: clock[0], rng=random.Random(seed))
    ids = [f"r{i}" for i in range(num_replicas)]
    core.set_replicas([ReplicaInfo(r, f"n{i // 8}") for i, r in enumerate(ids)])
    groups = [chain(f"g{g}", rng.randrange(64, 257)) for g in range(40 * num_replicas // 2)]
    for i, rid in enumerate(ids):
        held = [b for g in rng.sample(groups, 40) for b in g]
        core.on_kv_events(KVEventBatch(rid, "e", 0, [BlockStored(held, None, [], 16)]))
    weights = [1.0 / (k + 1) for k in range(len(groups))]
    wall, cpu = [], []
    for n in range(num_requests):
        clock[0] += 0.01
        if n % 50 == 0:
            for rid in ids:
                core.on_stats(rid, ReplicaLoadView(num_running=rng.randrange(0, 64),
                                                   num_queued_prefill_tokens=rng.randrange(0, 8000),
                                                   kv_cache_usage=rng.random()))
        g = rng.choices(groups, weights)[0]
        hashes = g + chain(f"q{n}", rng.randrange(8, 65))
        request = RouteRequest(f"req{n}", hashes, len(hashes) * 16, 256)
        start, start_cpu = time.perf_counter(), time.thread_time()
        decision = core.route(request, ids)
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        core.on_first_token(decision.req_id, num_cached_tokens=0)
        core.on_finished(decision.req_id)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    print(f"{'replicas':>8} {'wall p50':>9} {'wall p99':>9} {'wall max':>9} {'cpu p50':>9} {'cpu p99':>9} "
          f"{'cpu max':>9}   (ms)")
    for n in (8, 32, 128):
        cols = []
        for t in map(sorted, run(n, args.requests)):
            cols += [statistics.median(t), t[int(0.99 * (len(t) - 1))], t[-1]]
        print(f"{n:>8} " + " ".join(f"{c * 1e3:>9.3f}" for c in cols))


if __name__ == "__main__":
    main()
