"""Does warming a joining replica pay? TTFT of the first affinity requests on a new (empty-cache) replica,
with and without prefilling the hot prefixes first (LLMReplica.warm, what the router does on join).

One in-process LLMReplica on the demo model (no Ray). Each round empties its prefix cache, then:
  cold   the first request of each of `--prefixes` hot prefixes (prefix + a unique suffix), one at a time
  warm   LLMReplica.warm(the prefixes) first (its time reported apart: it runs off the request path, before
         affinity traffic finds the replica), then the same requests
Rounds alternate cold/warm so machine noise hits both alike. Prints a table (TTFT mean/p50/max, cached
tokens, warm-up time, ratio warm/cold) and optionally writes JSON.

    python -m benchmarks.warmup [--quick] [--prefixes 8] [--prefix-tokens 512] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from pathlib import Path

from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.app.replica import LLMReplica
from affinity_serve.engine import SamplingParams, ensure_demo_model
from affinity_serve.engine import EngineConfig


def _prompts(n: int, prefix_tokens: int, suffix_tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 500) for _ in range(prefix_tokens)] for _ in range(n)]
    requests = [p + [rng.randrange(10, 500) for _ in range(suffix_tokens)] for p in prefixes]
    return prefixes, requests


async def _ttft(rep: LLMReplica, ids: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    req = GenerateRequest(uuid.uuid4().hex, ids, SamplingParams(max_tokens=1, temperature=0.0))
    async for c in rep.generate(req):
        if c.token_ids:
            return time.perf_counter() - start, c.num_cached_tokens
    raise RuntimeError("no token")


async def _round(rep: LLMReplica, warm: bool, prefixes, requests) -> dict:
    assert await rep.reset_prefix_cache()
    warm_s = 0.0
    if warm:
        t = time.perf_counter()
        await rep.warm(prefixes)
        warm_s = time.perf_counter() - t
    ttfts, cached = [], []
    for ids in requests:
        s, c = await _ttft(rep, ids)
        ttfts.append(s)
        cached.append(c)
    return {"warm": warm, "warm_s": warm_s, "ttft_s": ttfts, "cached": cached}


def _summary(rounds: list[dict], warm: bool) -> dict:
    mine = [r for r in rounds if r["warm"] is warm]
    ttfts = [t for r in mine for t in r["ttft_s"]]
    return {"mode": "warm" if warm else "cold", "n": len(ttfts), "ttft_mean_ms": 1e3 * statistics.mean(ttfts),
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts),
            "cached_mean": statistics.mean(c for r in mine for c in r["cached"]),
            "warm_up_s": statistics.mean(r["warm_s"] for r in mine)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prefixes of 256 tokens, 1 round each")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (alternating)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the replica")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.prefixes, args.prefix_tokens, args.rounds = 4, 256, 1
    prefixes, requests = _prompts(args.prefixes, args.prefix_tokens, args.suffix_tokens, seed=0)
    rep = LLMReplica(EngineConfig(model=str(ensure_demo_model()), num_threads=args.threads,
                      cache={"block_size": 16, "num_blocks": 2 * args.prefixes * (args.prefix_tokens // 16 + 4)}))
    await _round(rep, True, prefixes[:1], requests[:1])             # warm the process (kernels, allocator)
    rounds = []
    for i in range(args.rounds):
        for warm in ((False, True) if i % 2 == 0 else (True, False)):
            rounds.append(await _round(rep, warm, prefixes, requests))
    await rep.engine.shutdown()
    cold, warm = _summary(rounds, False), _summary(rounds, True)
    saved_s = (cold["ttft_mean_ms"] - warm["ttft_mean_ms"]) / 1e3 * args.prefixes
    print(f"{args.prefixes} hot prefixes x {args.prefix_tokens} tokens, suffix {args.suffix_tokens}, "
          f"{args.rounds} round(s) per mode, block 16")
    print(f"{'mode':<6}{'TTFT mean ms':>14}{'p50 ms':>9}{'max ms':>9}{'cached':>9}{'warm-up s':>11}")
    for s in (cold, warm):
        print(f"{s['mode']:<6}{s['ttft_mean_ms']:>14.1f}{s['ttft_p50_ms']:>9.1f}{s['ttft_max_ms']:>9.1f}"
              f"{s['cached_mean']:>9.0f}{s['warm_up_s']:>11.3f}")
    print(f"warm/cold TTFT ratio {warm['ttft_mean_ms'] / cold['ttft_mean_ms']:.2f}; TTFT saved over the first "
          f"{args.prefixes} requests {saved_s:.3f} s vs warm-up {warm['warm_up_s']:.3f} s of replica time "
          "(off the request path)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cold": cold,
                                         "warm": warm, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
