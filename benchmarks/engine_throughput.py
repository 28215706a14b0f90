"""Our engine vs transformers.generate on the same ~56M-parameter random Llama, same process.

Interleaved A/B, best of N, fixed seeds, greedy, 64 new tokens forced (no EOS):
  (1) 32 requests x 128-token prompts     (2) 32 requests x (512 shared + 32 unique) prompts
  (3) batch 1, 128-token prompt
Prints output tokens/s for both and the ratio; --json writes the rows. Our prefix cache is reset
before every run so repetitions never see an earlier run's blocks.

    python benchmarks/engine_throughput.py [--reps 3] [--threads 2] [--json out.json] [--ablate]

--ablate adds case (1) with our CPU speed-ups switched off (F.linear instead of oneDNN prepacked weights;
pure-torch decode attention instead of the C kernel; the torch per-token ops instead of the C fused ones),
and case (3) without the plain weights that `linear_backend: hybrid` keeps for 1-2 row steps and without
the C per-token ops. The parts are switched on the default engine itself (only the F.linear rows need a
second engine), and a case's variants run interleaved with it and with transformers in every repetition;
each row gives its ratio to transformers and to our default engine ("vs default": below 1 means the
switched-off part was worth that much).
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
    # (case, label, linears, C decode kernel on, C per-token ops on); linears: "default" (hybrid: prepacked,
    # plus the plain copy for 1-2 row steps), "packed" (the same engine with the plain copy unused) or
    # "F.linear" (a second engine with linear_backend torch)
    ablations = [
        ("3", "oneDNN alone (plain copy unused)", "packed", True, True),
        ("3", "hybrid, torch per-token ops", "default", True, False),
        ("3", "oneDNN alone, torch per-token ops", "packed", True, False),
        ("1", "F.linear, torch decode, torch ops", "F.linear", False, False),
        ("1", "oneDNN, torch decode, torch ops", "default", False, False),
        ("1", "F.linear, C decode, C ops", "F.linear", True, True),
        ("1", "oneDNN, C decode, torch ops", "default", True, False),
    ] if args.ablate else []
    full = ("default", True, True)
    flinear = None

    def configure(linears: str, c_decode: bool, c_ops: bool):
        """The engine for `linears` with the C parts switched on or off in place: every variant but F.linear
        runs on the default engine itself, so no two variants differ in where their weights sit in memory."""
        nonlocal flinear
        if linears == "F.linear" and flinear is None:
            flinear = LLM(path, **engine_kw, linear_backend="torch")
            run_ours(flinear, prompts(2, 16))
        engine = flinear if linears == "F.linear" else llm
        runner = engine.engine.runner
        runner.backend.decode_kernel = kernel if c_decode else None
        runner.model.use_fused_ops(c_ops and c_ops_impl is not None, ops=c_ops_impl or runner.model.ops)
        for m in runner.model.modules():
            if isinstance(m, PackedLinear) and m.plain_t is not None:
                m.plain_rows = 0 if linears == "packed" else HYBRID_PLAIN_ROWS
        return engine

    from engine.models.linear import HYBRID_PLAIN_ROWS, PackedLinear
    kernel, c_ops_impl = llm.engine.runner.backend.decode_kernel, llm.engine.runner.model.ops
    if not llm.engine.runner.model.fused:
        c_ops_impl = None
    rows = []
    for key in args.cases.split(","):
        name, ps = cases[key]
        # a case's variants run interleaved with it and with transformers in every repetition, so the
        # machine's drift hits them all alike
        group = [(name, full)] + [(f"  {label}", cfg) for k, label, *cfg in ablations if k == key]
        best = {who: float("inf") for who in ["hf", *range(len(group))]}
        for rep in range(args.reps):
            for who in best:
                if who == "hf":
                    dt, n = run_hf(hf, ps)
                else:
                    dt, n = run_ours(configure(*group[who][1]), ps)
                    configure(*full)
                assert n == len(ps) * NEW
                best[who] = min(best[who], dt)
                label = who if who == "hf" else ("ours" if who == 0 else group[who][0].strip())
                print(f"[engine_throughput] case {key} rep {rep + 1}/{args.reps} {label}: {dt:.2f}s", flush=True)
        n = len(ps) * NEW
        for i, (label, _) in enumerate(group):
            rows.append({"case": label, "hf_tok_s": round(n / best["hf"], 1), "ours_tok_s": round(n / best[i], 1),
                         "ratio": round(best["hf"] / best[i], 2), "vs_default": round(best[0] / best[i], 2),
                         "hf_s": round(best["hf"], 3), "ours_s": round(best[i], 3)})
    hdr = f"{'case':<38} {'transformers tok/s':>19} {'ours tok/s':>11} {'ratio':>6} {'vs default':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<38} {r['hf_tok_s']:>19.1f} {r['ours_tok_s']:>11.1f} {r['ratio']:>5.2f}x "
              f"{r['vs_default']:>9.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "reps": args.reps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
