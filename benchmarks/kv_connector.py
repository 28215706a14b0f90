"""KV connectors: what they cost when off or idle, and what a tier hit buys in TTFT.

Four questions, baselines in the same run:
1. Overhead (issue 11: "with no connector configured, behaviour and speed are exactly today's"): one
   scheduler step at 256 running decodes (best of 5 rounds' medians), and engine throughput (16 requests x
   64-token prompts, 16 new tokens, best of 5 per process), for the code before the connector (`--before`,
   default the commit preceding it, extracted with `git archive` into a temporary directory), the current
   code with no connector, and with an idle offload tier (configured, nothing to load). Each variant runs
   in its own subprocess, interleaved over `--reps`.
2. TTFT of a long prompt (default 2048 tokens, 16 fresh at the end) whose prefix is (a) in the paged pool,
   (b) in the offload tier (evicted from a small pool), (c) in the node-shared store (written by another
   engine), (d) nowhere (recomputed). Same engine settings, ~56M-parameter random Llama (as
   benchmarks/engine_throughput.py), float32 on CPU.
3. Load bandwidth: the bytes each tier load moved over the time the runner spent on it, against this
   machine's memory-copy bandwidth (torch copy_ of 256 MiB into a touched buffer; a fresh clone is shown
   too) measured in the same run.
4. Offload store policy: store on evict vs on finish vs no tier, on prefixes revisited under pool pressure.

    python -m benchmarks.kv_connector [--quick] [--reps 3] [--json out.json] [--png out.png]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = "affinity_serve.engine"

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
             vocab_size=32000, max_position_embeddings=4096, init_std=0.02)
BLOCK = 16


# ---------------------------------------------------------------- 1. overhead (runs in a subprocess)
def _engine_module(pkg: str, name: str = ""):
    """`pkg.name` of the engine under test: the installed `affinity_serve.engine`, or for the `before` variant
    the old top-level `engine` package that `overhead` extracts into the worker's working directory."""
    return importlib.import_module(f"{pkg}.{name}" if name else pkg)


def _scheduler_step_us(pkg: str, variant: str, steps: int) -> float:
    SchedulerConfig = _engine_module(pkg, "config").SchedulerConfig
    KVCacheManager = _engine_module(pkg, "kv_cache_manager").KVCacheManager
    Request = _engine_module(pkg, "request").Request
    SamplingParams = _engine_module(pkg, "sampling_params").SamplingParams
    Scheduler = _engine_module(pkg, "scheduler").Scheduler
    ModelRunnerOutput = _engine_module(pkg, "types").ModelRunnerOutput

    n, max_len = 256, 8192
    kv = KVCacheManager(n * 40 + 16, BLOCK, max_len)
    kw = {}
    if variant == "offload-idle":
        kvc = _engine_module(pkg, "kv_connector")
        KVLayout, OffloadConnectorScheduler = kvc.KVLayout, kvc.OffloadConnectorScheduler
        kw["kv_connector"] = OffloadConnectorScheduler(KVLayout(8, 4, 64, BLOCK, "float32", 4), 4096)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=n + 4096, max_num_seqs=n + 1), kv, max_len, **kw)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0)
    for i in range(n):
        s.add_request(Request(f"d{i}", [(i * 31 + j) % 30000 + 3 for j in range(128)], params, eos_token_id=2,
                              block_size=BLOCK))

    def one():
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    for _ in range(5):
        one()
    medians = []
    for _ in range(5):              # best of 5 rounds' medians: another process's burst hits one round
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def _engine_tokens_per_s(pkg: str, variant: str, model: str, threads: int) -> float:
    import torch
    engine = _engine_module(pkg)
    LLM, SamplingParams = engine.LLM, engine.SamplingParams
    torch.manual_seed(0)
    kw = {}
    if variant == "offload-idle":
        kw["kv_connector"] = {"type": "offload", "capacity_blocks": 4096}
    llm = LLM(model, num_threads=threads, cache={"num_blocks": 1024, "block_size": BLOCK}, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (64,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)          # warm up
    best = 0.0
    for _ in range(5):              # best of 5 in one process: bursts of other load hit single runs
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    return best


def _worker_main(args) -> None:
    if args.worker == "sched":
        print(json.dumps({"step_us": _scheduler_step_us(args.engine_package, args.variant, args.steps)}))
    else:
        print(json.dumps({"tok_s": _engine_tokens_per_s(args.engine_package, args.variant, args.model,
                                                        args.threads)}))


def _run_worker(before_dir: str | None, kind: str, variant: str, extra: list[str]) -> dict:
    """One measurement in a fresh process. With `before_dir` the worker runs there (its working directory comes
    first on sys.path, so the old top-level `engine/` extracted there is the one imported) and finds this
    module through PYTHONPATH."""
    cmd = [sys.executable, "-m", "benchmarks.kv_connector", "--worker", kind, "--variant", variant, *extra]
    if before_dir is None:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    else:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        out = subprocess.run([*cmd, "--engine-package", "engine"], cwd=before_dir, env=env, capture_output=True,
                             text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def overhead(args, model: str) -> list[dict]:
    before_dir = tempfile.mkdtemp(prefix="kvc-before-")
    tar = subprocess.run(["git", "-C", str(REPO), "archive", args.before, "engine"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", before_dir], input=tar.stdout, check=True)
    variants = [("before", before_dir, "off"), ("off", None, "off"), ("offload-idle", None, "offload-idle")]
    rows = {name: {"variant": name, "step_us": [], "tok_s": []} for name, _, _ in variants}
    for _ in range(args.reps):
        for name, root, v in variants:
            rows[name]["step_us"].append(_run_worker(root, "sched", v, ["--steps", str(args.steps)])["step_us"])
            rows[name]["tok_s"].append(_run_worker(root, "engine", v, ["--model", model, "--threads",
                                                                         str(args.threads)])["tok_s"])
    out = []
    base = rows["before"]
    for name, _, _ in variants:
        r = rows[name]
        step, tok = min(r["step_us"]), max(r["tok_s"])
        out.append({"variant": name, "step_us_median": step, "tok_s_best": tok,
                    "step_vs_before": step / min(base["step_us"]),
                    "tok_s_vs_before": tok / max(base["tok_s"]), "runs": r})
    return out


# ---------------------------------------------------------------- 2 + 3. TTFT and bandwidth
def _ttft(engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    from affinity_serve.engine import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                           req_id=rid))
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for d in engine.step().deltas:
            if d.req_id == rid and d.token_ids and ttft is None:
                ttft, cached = time.perf_counter() - t0, d.num_cached_tokens
    assert ttft is not None
    return ttft, cached


class _LoadTimer:
    """Wraps the runner side's per-transfer load: the time and bytes of every load (stores excluded)."""

    def __init__(self, worker, block_bytes: int):
        self.block_bytes = block_bytes
        self.seconds, self.bytes = 0.0, 0
        self._inner = worker._load
        worker._load = self

    def __call__(self, transfer, out):
        t0 = time.perf_counter()
        ok = self._inner(transfer, out)
        self.seconds += time.perf_counter() - t0
        self.bytes += len(transfer.block_ids) * self.block_bytes
        return ok


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> tuple[float, float]:
    """(torch clone of a 256 MiB buffer: a fresh allocation, page faults included; copy_ into a buffer
    already touched), best of `reps`, in GB copied per second."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    clone = min(_timed(src.clone) for _ in range(reps))
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return nbytes / clone / 1e9, nbytes / copy / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ttft_cases(args, model: str) -> dict:
    import torch
    from affinity_serve.engine.config import EngineConfig
    from affinity_serve.engine.llm_engine import LLMEngine
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(7)
    plen = args.prompt_len
    num_blocks_small = plen // BLOCK + 8          # the prompt fits; a second long prompt evicts it
    shared_dir = tempfile.mkdtemp(prefix="kvc-shared-")

    def engine(kv_connector=None, num_blocks=4 * plen // BLOCK + 16):
        cfg = {"model": model, "num_threads": args.threads, "cache": {"num_blocks": num_blocks, "block_size": BLOCK}}
        if kv_connector:
            cfg["kv_connector"] = kv_connector
        return LLMEngine.from_config(EngineConfig(**cfg))

    def rand(n):
        return torch.randint(3, 32000, (n,), generator=g).tolist()

    pool_eng = engine()
    off_eng = engine({"type": "offload", "capacity_blocks": 8 * plen // BLOCK}, num_blocks=num_blocks_small)
    shared_cfg = {"type": "shared", "capacity_blocks": 8 * plen // BLOCK, "shared_dir": shared_dir}
    writer, reader = engine(shared_cfg), engine(shared_cfg)
    block_bytes = off_eng.kv_connector.layout.block_bytes
    timers = {"offload": _LoadTimer(off_eng.runner.kv_connector, block_bytes),
              "shared": _LoadTimer(reader.runner.kv_connector, block_bytes)}
    res: dict[str, list] = {k: [] for k in ("pool", "offload", "shared", "none")}
    cached: dict[str, int] = {}
    _ttft(pool_eng, "warm", rand(64))
    for rep in range(-1, args.ttft_reps):          # rep -1 warms every path up (first-touch page faults)
        prefix = rand(plen - 16)
        # (a) pool: compute the prefix, then ask again with a new tail
        _ttft(pool_eng, f"a0-{rep}", prefix + rand(16))
        t, cached["pool"] = _ttft(pool_eng, f"a1-{rep}", prefix + rand(16))
        res["pool"].append(t)
        # (b) offload: compute, evict with another long prompt, ask again
        _ttft(off_eng, f"b0-{rep}", prefix + rand(16))
        _ttft(off_eng, f"b1-{rep}", rand(plen))
        t, cached["offload"] = _ttft(off_eng, f"b2-{rep}", prefix + rand(16))
        res["offload"].append(t)
        # (c) shared: another engine computed it
        _ttft(writer, f"c0-{rep}", prefix + rand(16))
        while writer.has_unfinished_requests():
            writer.step()                  # its last blocks reach the store
        t, cached["shared"] = _ttft(reader, f"c1-{rep}", prefix + rand(16))
        res["shared"].append(t)
        # (d) nowhere
        t, cached["none"] = _ttft(pool_eng, f"d-{rep}", rand(plen))
        res["none"].append(t)
        if rep < 0:
            res = {k: [] for k in res}
            for timer in timers.values():
                timer.seconds, timer.bytes = 0.0, 0
    for e in (off_eng, writer, reader):
        e.close()
    clone, copy = memcpy_gbps()
    out = {"prompt_len": plen, "block_bytes": block_bytes, "memcpy_gbps": copy, "clone_gbps": clone, "cases": {}}
    for k, v in res.items():
        row = {"ttft_s_median": statistics.median(v), "ttft_s": v, "cached_tokens": cached[k]}
        if k in timers and timers[k].seconds:
            gbps = timers[k].bytes / timers[k].seconds / 1e9
            row.update(load_gbps=gbps, load_vs_memcpy=gbps / copy, load_s_per_request=timers[k].seconds / len(v))
        out["cases"][k] = row
    return out


# ---------------------------------------------------------------- 4. store on evict vs on finish
def store_policy(args, model: str) -> list[dict]:
    """Prefixes revisited under pool pressure: what each store policy copies and what it saves."""
    import random

    from affinity_serve.engine import SamplingParams
    from affinity_serve.engine.config import EngineConfig
    from affinity_serve.engine.llm_engine import LLMEngine
    plen = args.prompt_len // 2
    rows = []
    for pool, store_on in [(p, s) for p in ("small", "large") for s in ("none", "evict", "finish")]:
        rng = random.Random(11)
        prefixes = [[rng.randrange(3, 32000) for _ in range(plen)] for _ in range(6)]
        num_blocks = 2 * plen // BLOCK + 8 if pool == "small" else 8 * plen // BLOCK
        cfg = {"model": model, "num_threads": args.threads, "cache": {"num_blocks": num_blocks, "block_size": BLOCK}}
        if store_on != "none":
            cfg["kv_connector"] = {"type": "offload", "capacity_blocks": 8 * plen // BLOCK, "store_on": store_on}
        eng = LLMEngine.from_config(EngineConfig(**cfg))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        for i in range(args.policy_requests):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 32000) for _ in range(8)]
            eng.add_request(eng.make_request(prompt, params, req_id=f"p{i}"))
            while eng.has_unfinished_requests():
                eng.step()
        wall = time.perf_counter() - t0
        kv = eng.kv_cache_manager.stats
        st = eng.kv_connector.stats if eng.kv_connector is not None else None
        rows.append({"pool": pool, "store_on": store_on, "wall_s": wall, "hit_rate": kv.hits / kv.queries,
                     "stored_blocks": st.stored_blocks if st else 0, "loaded_blocks": st.loaded_blocks if st else 0})
        eng.close()
    return rows


# ---------------------------------------------------------------- main
def main() -> None:
    """Every model, store and old-code directory goes under one scratch folder, removed at the end."""
    scratch = tempfile.mkdtemp(prefix="kvc-bench-")
    tempfile.tempdir = scratch
    try:
        _main()
    finally:
        tempfile.tempdir = None
        shutil.rmtree(scratch, ignore_errors=True)


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one rep, 512-token prompt, fewer steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", default="7be17d7^", help="git revision of the code before the connector")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--policy-requests", type=int, default=24)
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--engine-package", default=ENGINE, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.reps, args.ttft_reps, args.steps, args.prompt_len, args.policy_requests = 1, 1, 100, 512, 12
    from affinity_serve.engine.demo import write_demo_model
    model = str(Path(tempfile.mkdtemp(prefix="kvc-model-")) / "llama56m")
    write_demo_model(model, arch="llama", seed=0, **MODEL)
    result: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "variant", "model")}}
    if not args.skip_overhead:
        result["overhead"] = overhead(args, model)
        print("\n== connector off / idle vs the code before it (scheduler step at 256 decodes: best of the runs'"
              " medians; engine tok/s: best run)")
        print(f"{'variant':<14}{'step us':>10}{'x before':>10}{'tok/s':>10}{'x before':>10}")
        for r in result["overhead"]:
            print(f"{r['variant']:<14}{r['step_us_median']:>10.1f}{r['step_vs_before']:>10.3f}"
                  f"{r['tok_s_best']:>10.1f}{r['tok_s_vs_before']:>10.3f}")
    t = result["ttft"] = ttft_cases(args, model)
    print(f"\n== TTFT, {t['prompt_len']}-token prompt (prefix {t['prompt_len'] - 16}), block {t['block_bytes']} B;"
          f" memory copy {t['memcpy_gbps']:.2f} GB/s (copy_ into a touched buffer; clone {t['clone_gbps']:.2f})")
    print(f"{'prefix in':<10}{'TTFT ms':>10}{'x none':>8}{'cached':>8}{'load GB/s':>11}{'x memcpy':>10}{'load ms':>9}")
    none = t["cases"]["none"]["ttft_s_median"]
    for k, r in t["cases"].items():
        bw = f"{r['load_gbps']:>11.2f}{r['load_vs_memcpy']:>10.2f}{r['load_s_per_request'] * 1e3:>9.1f}" \
            if "load_gbps" in r else f"{'':>30}"
        print(f"{k:<10}{r['ttft_s_median'] * 1e3:>10.1f}{r['ttft_s_median'] / none:>8.3f}{r['cached_tokens']:>8}{bw}")
    result["store_policy"] = store_policy(args, model)
    print(f"\n== offload store policy: {args.policy_requests} requests over 6 prefixes of {args.prompt_len // 2} "
          "tokens, a small pool (holds 2 of them) and a large one (holds all)")
    print(f"{'pool':<7}{'store_on':<10}{'wall s':>8}{'hit rate':>10}{'stored blk':>12}{'loaded blk':>12}")
    for r in result["store_policy"]:
        print(f"{r['pool']:<7}{r['store_on']:<10}{r['wall_s']:>8.2f}{r['hit_rate']:>10.3f}{r['stored_blocks']:>12}"
              f"{r['loaded_blocks']:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3))
        names = list(t["cases"])
        ax.bar(names, [t["cases"][k]["ttft_s_median"] * 1e3 for k in names])
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{t['prompt_len']}-token prompt: where its prefix was")
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
