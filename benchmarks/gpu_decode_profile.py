"""Where a decode step's time goes on a GPU: the full engine step (in order, and overlapped with the host's
work by overlap_decode), the CUDA-graph replay alone, and the lm_head + argmax + host copy, at batch 1 and
32 (the Llama-3.2-1B-shaped model of engine_throughput_gpu.py, bf16, 512-token prompts); with --kernels, a
torch.profiler table of an eager (no-graph) step's kernels, and a cProfile of the host side. Then batch 32
sharing a 512-token prefix: the cascade graph's replay against the plain graph's on the same inputs (what
cascade decode buys, without the host). With --sweep, one layer's decode attention alone (the Triton
backend, Llama-3.2-1B's heads, bf16) at batch 32 and 128 on a shared 512- or 2048-token prefix: plain
split-K decode against cascade decode at each count of prefix splits P, to choose P and the threshold.
The step breakdown in docs/benchmarks/gpu-throughput.md comes from this script.

    python -m benchmarks.gpu_decode_profile [--kernels] [--sweep]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time

import torch

from benchmarks.engine_throughput_gpu import LLAMA_1B, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true", help="also profile an eager step's kernels and the host")
    ap.add_argument("--sweep", action="store_true", help="also time one layer's decode attention, cascade "
                    "at each prefix split count against plain")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.sweep:
        attention_sweep(torch.device("cuda"))
    from affinity_serve.engine import LLM, SamplingParams
    from affinity_serve.engine.demo import write_demo_model

    path = write_demo_model(tempfile.mkdtemp(prefix="affinity-gpu-profile-"), dtype="bfloat16", **LLAMA_1B)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, detokenize=False)

    def engine(batch: int, eager: bool, prefix: int = 0):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=eager,
                  cache={"block_size": 16, "memory_budget_bytes": 8 << 30},
                  scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 64})
        eng = llm.engine
        for i, p in enumerate(prompts(batch, 32 if prefix else 512, prefix, LLAMA_1B["vocab_size"])):
            eng.add_request(eng.make_request(p, params, req_id=f"r{i}"))
        for _ in range(12):                     # the prefill and a few decode steps
            eng.step()
        torch.cuda.synchronize()
        return llm, eng

    def timed(fn, n: int = 50) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    for batch in (1, 32):
        llm, eng = engine(batch, eager=False)
        graphs = eng.runner.decode_graphs
        graph, out = graphs.graphs[(graphs.padded_size(batch), False)]     # no shared prefix: the plain graph
        model = eng.runner.model
        overlap = eng.runner.overlap_decode
        eng.runner.overlap_decode = False
        eng.runner._ahead = None                    # a step launched before the switch is not used
        step = timed(eng.step)                      # in order: the host's work adds to the GPU's
        eng.runner.overlap_decode = overlap
        step_overlapped = timed(eng.step) if overlap else float("nan")
        replay = timed(graph.replay)
        with torch.inference_mode():
            logits = timed(lambda: model.compute_logits(out[:batch]).argmax(-1).tolist())
        print(f"batch {batch}: engine step in order {step * 1e3:.3f} ms = graph replay {replay * 1e3:.3f} ms + "
              f"lm_head, argmax and copy {logits * 1e3:.3f} ms + host {max(step - replay - logits, 0) * 1e3:.3f} ms; "
              f"overlapped (overlap_decode) {step_overlapped * 1e3:.3f} ms", flush=True)
        if args.kernels:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                eng.step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        del llm, eng
        torch.cuda.empty_cache()
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile
            llm, eng = engine(batch, eager=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    eng.step()
                torch.cuda.synchronize()
            print(f"eager, batch {batch}, 5 decode steps:")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=50))
            del llm, eng
            torch.cuda.empty_cache()

    llm, eng = engine(32, eager=False, prefix=512)
    graphs = eng.runner.decode_graphs
    eng.runner.overlap_decode = False
    eng.runner._ahead = None
    eng.step()                                      # an in-order step: the buffers hold this batch, prefix found
    torch.cuda.synchronize()
    if (32, True) not in graphs.graphs or not int(graphs.cascade_len):
        print("batch 32 on a shared 512-token prefix: no cascade graph or no shared prefix found", flush=True)
        return
    cascade, plain = (timed(graphs.graphs[(32, c)][0].replay) for c in (True, False))
    print(f"batch 32 on a shared 512-token prefix ({int(graphs.cascade_len)} tokens in shared pages): graph replay "
          f"with cascade decode {cascade * 1e3:.3f} ms, without {plain * 1e3:.3f} ms ({plain / cascade:.2f}x)",
          flush=True)


def _forced_prefix_splits(p: int, real):
    """`triton_paged.prefix_splits` with the split count fixed at p (the row tile as the real one picks it)."""
    def splits(device, rows, num_kv_heads, max_splits=16):
        return p, real(device, rows, num_kv_heads, max_splits)[1]
    return splits


def attention_sweep(device: torch.device, batches=(32, 128), prefixes=(512, 2048), tail: int = 32,
                    splits=(1, 2, 4, 8, 16), heads: int = 32, kv_heads: int = 8, head_dim: int = 64,
                    dtype=torch.bfloat16, iters: int = 200) -> list[dict]:
    """Per-call time of one layer's decode attention: `batch` decodes, each at prefix + tail + i % 16 tokens,
    whose first `prefix` tokens are the same pages. Rows of plain (split-K over each request's keys) and
    cascade at each prefix split count P (the kernel's default P marked), printed as a table and returned."""
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention import triton_paged as tp

    bs = 16
    rows, default_p = [], {}
    real_prefix_splits = tp.prefix_splits
    try:
        for batch in batches:
            for prefix in prefixes:
                pb = prefix // bs
                lens = [prefix + tail + i % 16 for i in range(batch)]       # tokens cached before this step
                nxt = pb
                tables = []
                for n in lens:
                    own = -(-(n + 1) // bs) - pb
                    tables.append(list(range(pb)) + list(range(nxt, nxt + own)))
                    nxt += own
                g = torch.Generator(device="cpu").manual_seed(0)
                cache = (torch.randn((2, kv_heads, nxt, bs, head_dim), generator=g) * 0.5).to(device, dtype)
                q = torch.randn((batch, heads, head_dim), generator=g).to(device, dtype)
                k = torch.randn((batch, kv_heads, head_dim), generator=g).to(device, dtype)
                v = torch.randn((batch, kv_heads, head_dim), generator=g).to(device, dtype)
                meta = build_attention_metadata(lens, [1] * batch, tables, bs, device=device)
                assert meta.num_common_prefix_blocks == pb, (meta.num_common_prefix_blocks, pb)
                default_p[(batch, prefix)] = real_prefix_splits(device, batch * heads // kv_heads, kv_heads)[0]

                def timed(backend) -> float:
                    """Microseconds per call: on CUDA, of a graph of 20 calls replayed (no launch gaps)."""
                    def call():
                        backend.forward(q, k, v, cache, meta, head_dim ** -0.5)
                    for _ in range(3):
                        call()
                    if device.type != "cuda":
                        t = time.perf_counter()
                        for _ in range(iters):
                            call()
                        return (time.perf_counter() - t) / iters * 1e6
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(20):
                            call()
                    graph.replay()
                    torch.cuda.synchronize(device)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(max(1, iters // 20)):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize(device)
                    return start.elapsed_time(end) / (max(1, iters // 20) * 20) * 1e3

                tp.prefix_splits = real_prefix_splits
                plain = timed(tp.TritonPagedAttention(cascade_min_tokens=None))
                ref = tp.TritonPagedAttention(cascade_min_tokens=None).forward(q, k, v, cache.clone(), meta,
                                                                               head_dim ** -0.5).float()
                row = {"batch": batch, "prefix": prefix, "plain_us": plain, "cascade_us": {}}
                for p in splits:
                    tp.prefix_splits = _forced_prefix_splits(p, real_prefix_splits)
                    backend = tp.TritonPagedAttention(cascade_min_tokens=16)
                    out = backend.forward(q, k, v, cache.clone(), meta, head_dim ** -0.5).float()
                    if not backend.num_cascade_forwards:
                        raise RuntimeError(f"batch {batch}, prefix {prefix}: the cascade path did not run")
                    err = (out - ref).abs().max().item()
                    row["cascade_us"][p] = timed(backend)
                    row.setdefault("max_abs_diff", {})[p] = err
                rows.append(row)
    finally:
        tp.prefix_splits = real_prefix_splits
    print(f"one layer's decode attention ({heads} heads, {kv_heads} KV heads, head dim {head_dim}, {dtype}, "
          f"block {bs}; tail {tail}-{tail + 15} own tokens), microseconds per call; * = the default P", flush=True)
    print(f"{'batch':>5} {'prefix':>6} {'plain':>8} " + " ".join(f"{'P=' + str(p):>9}" for p in splits)
          + "  best/plain  max|diff|")
    for r in rows:
        best = min(r["cascade_us"].values())
        dp = default_p[(r["batch"], r["prefix"])]
        cells = " ".join(f"{r['cascade_us'][p]:8.1f}{'*' if p == dp else ' '}" for p in splits)
        print(f"{r['batch']:>5} {r['prefix']:>6} {r['plain_us']:8.1f} {cells}  {r['plain_us'] / best:9.2f}x  "
              f"{max(r['max_abs_diff'].values()):.2e}", flush=True)
    return rows


if __name__ == "__main__":
    main()
