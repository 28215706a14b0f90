"""Fleet-suite configurations over several seeds: mean and spread of each router's hit rate (÷ the
separate-caches bound) and TTFT p99 (÷ a reference router's on the same trace).

One seed per configuration cannot tell a knob's effect on TTFT p99 from the trace: a single trace's p99
moves by about ±10% between router variants. Each (configuration, seed) is one trace, written to its own JSON
(`fleet_n8_p0.75_l1.5_e0.5_s1.json`) and kept when present, so runs can be split (`--only 6 --seeds 3`)
and the summary covers whatever is in the folder:

    python -m benchmarks.routing.seeds --only 3,5,6,9 --seeds 0-4 --out-dir bench-seeds \\
        --routers llmd,ours:release_cache_weight=0,ours:release_cache_weight=1
    python -m benchmarks.routing.seeds --out-dir bench-seeds --summarize    # the table of what is there
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.routing import report

#: the reference router of the TTFT p99 ratio (the best baseline in every 8-replica fleet cell at load >= 1)
REFERENCE = "llm-d precise"


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run(only: list[int], seeds: list[int], routers: str, out: Path, say) -> None:
    from benchmarks.routing.simulator import FLEET, FLEET_KV_BLOCKS, _fleet_stem, _run_one
    out.mkdir(parents=True, exist_ok=True)
    for k in only:
        n, rho, load, hot, rpr, period = FLEET[k - 1]
        for seed in seeds:
            path = Path(f"{_fleet_stem(out, n, rho, load, hot, period)}_s{seed}.json")
            if path.exists():
                say(f"{path.name} exists: kept")
                continue
            say(f"[{k}] {n} replicas, pressure {rho}, load {load}, events every {period} s, seed {seed}")
            a = argparse.Namespace(replicas=n, pressure=rho, load=load, hot=hot, seed=seed,
                                   requests_per_replica=rpr, long_tail=True, kv_blocks=FLEET_KV_BLOCKS,
                                   routers=routers, events_period=period, stats_period=None, trace=None)
            doc = _run_one(a, _spec(a), say, None)
            report.write_json(doc, path)


def _spec(a: argparse.Namespace):
    from benchmarks.routing.workload import spec_from_args
    return spec_from_args(a)


def _label(cfg: dict) -> str:
    shape = "hot prefix" if cfg.get("hot_prefix") else f"ρ {cfg['pressure_target']}"
    return f"{cfg['replicas']} × {shape}, load {cfg['load_target']}, events {cfg['events_period_s']} s"


def summarize(docs: list[dict]) -> str:
    """Per configuration and router: seeds, hit ÷ separate bound (mean, min-max, seeds meeting 0.97), TTFT p99
    ÷ the reference's on the same trace (geometric mean, min-max) and the mean TTFT p99."""
    by_cfg: dict[str, list[dict]] = defaultdict(list)
    for d in docs:
        by_cfg[_label(d["config"])].append(d)
    rows = ["| configuration | router | seeds | hit ÷ bound: mean (min-max) | seeds ≥ 0.97 | TTFT p99 ÷ "
            f"{REFERENCE}: geo-mean (min-max) | TTFT p99 s: mean |", "|---|---|---|---|---|---|---|"]
    for label in sorted(by_cfg, key=lambda s: tuple(by_cfg[s][0]["config"].get(k, False) for k in
                                                    ("replicas", "events_period_s", "hot_prefix",
                                                     "pressure_target", "load_target"))):
        per_router: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for d in sorted(by_cfg[label], key=lambda d: d["config"]["seed"]):
            ref = next((r for r in d["results"] if r["router"].startswith(REFERENCE)), None)
            for r in d["results"]:
                ratio = r["ttft_p99_s"] / ref["ttft_p99_s"] if ref else math.nan
                per_router[r["router"]].append((r["hit_vs_separate_bound"], ratio, r["ttft_p99_s"]))
        for name, vals in per_router.items():
            hits, ratios, p99s = zip(*vals)
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            rows.append(f"| {label} | {name} | {len(vals)} | {sum(hits) / len(hits):.3f} ({min(hits):.3f}-"
                        f"{max(hits):.3f}) | {sum(h >= 0.97 for h in hits)}/{len(hits)} | {geo:.3f} "
                        f"({min(ratios):.2f}-{max(ratios):.2f}) | {sum(p99s) / len(p99s):.3f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="fleet-suite configurations (1-based, comma-separated, as simulator --only)")
    p.add_argument("--seeds", default="0-2", help="seeds: 0-4 or 0,3")
    p.add_argument("--routers", default="llmd,ours", help="as simulator --routers (ours:KNOB=VALUE variants)")
    p.add_argument("--out-dir", required=True, help="one JSON per configuration and seed; the summary")
    p.add_argument("--summarize", action="store_true", help="run nothing: summarize the folder")
    a = p.parse_args()

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out = Path(a.out_dir)
    if not a.summarize:
        if not a.only:
            p.error("--only names the configurations to run (or pass --summarize)")
        if any(r.startswith("ours") for r in a.routers.split(",")):
            import benchmarks.routing.ours  # noqa: F401  (load the core now: every run uses this version)
        say(f"source: {report.source_version()}")
        run([int(k) for k in a.only.split(",")], parse_seeds(a.seeds), a.routers, out, say)
    docs = [json.loads(f.read_text()) for f in sorted(out.glob("fleet_*_s*.json"))]
    table = summarize(docs)
    sources = sorted({json.dumps(d["source"], sort_keys=True) for d in docs})
    (out / "seeds_summary.md").write_text(f"source: {'; '.join(sources)}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
