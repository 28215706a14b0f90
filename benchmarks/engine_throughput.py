"""Our engine vs transformers.generate on the same ~56M-parameter random Llama, same process.

Interleaved A/B, best of N, fixed seeds, greedy, 64 new tokens forced (no EOS):
  (1) 32 requests x 128-token prompts     (2) 32 requests x (512 shared + 32 unique) prompts
  (3) batch 1, 128-token prompt
Prints output tokens/s for both and the ratio; --json writes the rows. Our prefix cache is reset
before every run so repetitions never see an earlier run's blocks.

    python benchmarks/engine_throughput.py [--reps 3] [--threads 2] [--json out.json] [--ablate]

--ablate adds case (1) with our CPU speed-ups switched off one at a time (F.linear instead of oneDNN
prepacked weights; pure-torch decode attention instead of the C kernel), each against the same
transformers baseline, to show what each contributes.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

NEW = 64
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
             vocab_size=32000, max_position_embeddings=2048, init_std=0.02)


def prompts(n: int, plen: int, prefix: int = 0, seed: int = 123) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pre = torch.randint(3, 32000, (prefix,), generator=g).tolist()
    return [pre + torch.randint(3, 32000, (plen,), generator=g).tolist() for _ in range(n)]


def run_hf(model, ps: list[list[int]]) -> tuple[float, int]:
    ids = torch.tensor(ps)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t, len(ps) * NEW


def run_ours(llm, ps: list[list[int]]) -> tuple[float, int]:
    from engine import SamplingParams
    assert llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cases", default="1,2,3")
    ap.add_argument("--ablate", action="store_true", help="also run case 1 with our speed-ups switched off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.demo import write_demo_model

    tmp = tempfile.mkdtemp(prefix="affinity-bench-")
    print(f"[engine_throughput] writing the benchmark model to {tmp} ...", flush=True)
    path = write_demo_model(tmp, **MODEL)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    engine_kw = dict(num_threads=args.threads, cache={"block_size": 16, "num_blocks": 4096},
                     scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 64})
    llm = LLM(path, **engine_kw)
    cases = {"1": ("32 x 128 -> 64", prompts(32, 128)),
             "2": ("32 x (512 shared + 32) -> 64", prompts(32, 32, prefix=512)),
             "3": ("batch 1, 128 -> 64", prompts(1, 128))}
    print("[engine_throughput] warming up ...", flush=True)
    run_hf(hf, prompts(2, 16))
    run_ours(llm, prompts(2, 16))
    runs = [(key, *cases[key], llm) for key in args.cases.split(",")]
    if args.ablate:
        for label, kw in (("1 (F.linear, torch decode)", dict(linear_backend="torch", cpu_kernels=False)),
                          ("1 (oneDNN, torch decode)", dict(linear_backend="auto", cpu_kernels=False)),
                          ("1 (F.linear, C decode)", dict(linear_backend="torch", cpu_kernels=True))):
            variant = LLM(path, **engine_kw, **kw)
            run_ours(variant, prompts(2, 16))
            runs.append((label, f"  {label.split(' ', 1)[1]}", cases["1"][1], variant))
    rows = []
    for key, name, ps, engine in runs:
        best = {"hf": float("inf"), "ours": float("inf")}
        for rep in range(args.reps):
            for who in ("hf", "ours"):            # interleaved A/B
                dt, n = run_hf(hf, ps) if who == "hf" else run_ours(engine, ps)
                assert n == len(ps) * NEW
                best[who] = min(best[who], dt)
                print(f"[engine_throughput] case {key} rep {rep + 1}/{args.reps} {who}: {dt:.2f}s", flush=True)
        n = len(ps) * NEW
        rows.append({"case": name, "hf_tok_s": round(n / best["hf"], 1), "ours_tok_s": round(n / best["ours"], 1),
                     "ratio": round(best["hf"] / best["ours"], 2), "hf_s": round(best["hf"], 3),
                     "ours_s": round(best["ours"], 3)})
    hdr = f"{'case':<32} {'transformers tok/s':>19} {'ours tok/s':>11} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<32} {r['hf_tok_s']:>19.1f} {r['ours_tok_s']:>11.1f} {r['ratio']:>5.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "reps": args.reps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
