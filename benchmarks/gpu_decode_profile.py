"""Where a decode step's time goes on a GPU: the full engine step (in order, and overlapped with the host's
work by overlap_decode), the CUDA-graph replay alone, and the lm_head + argmax + host copy, at batch 1 and
32 (the Llama-3.2-1B-shaped model of engine_throughput_gpu.py, bf16, 512-token prompts); with --kernels, a
torch.profiler table of an eager (no-graph) step's kernels, and a cProfile of the host side. Then batch 32
sharing a 512-token prefix: the cascade graph's replay against the plain graph's on the same inputs (what
cascade decode buys, without the host). The README's "GPU throughput" breakdown came from this script.

    python benchmarks/gpu_decode_profile.py [--kernels]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_throughput_gpu import LLAMA_1B, prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true", help="also profile an eager step's kernels and the host")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from engine import LLM, SamplingParams
    from engine.demo import write_demo_model

    path = write_demo_model(tempfile.mkdtemp(prefix="affinity-gpu-profile-"), dtype="bfloat16", **LLAMA_1B)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, detokenize=False)

    def engine(batch: int, eager: bool, prefix: int = 0):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=eager,
                  cache={"block_size": 16, "memory_budget_bytes": 8 << 30},
                  scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 64})
        eng = llm.engine
        for i, p in enumerate(prompts(batch, 32 if prefix else 512, prefix, LLAMA_1B["vocab_size"])):
            eng.add_request(f"r{i}", p, params)
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


if __name__ == "__main__":
    main()
