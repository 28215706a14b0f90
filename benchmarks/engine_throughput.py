"""Our engine vs transformers.generate on the same ~56M-parameter random Llama, same process.

Interleaved A/B, best of N, fixed seeds, greedy, 64 new tokens forced (no EOS):
  (1) 32 requests x 128-token prompts     (2) 32 requests x (512 shared + 32 unique) prompts
  (3) batch 1, 128-token prompt
and on models of their own (issue 31), ours vs transformers on the same checkpoint too:
  (moe) a Qwen3-MoE-shaped model (32 experts, top 4, renormalised), 32 x 128 -> 64; target >= 2x at batch 32.
      Also our engine with the torch experts (`grouped_experts`) in place of the C kernel, each engine's
      decode step ((time for 64 new tokens - time for 1) / 63, all runs interleaved), and the decode step's
      weight-read floor: the time to read once every weight a batch-32 step reads (all experts, attention,
      router, norms, lm_head; not the embedding table), measured as a reduction over those tensors
  (sliding) a Gemma-3-shaped model (5 sliding layers : 1 global, window 512), 2 x 8192 -> 16, and the KV blocks
      each KV-cache group holds while the requests decode: target, a sliding group holds <= window / context of
      what the full-attention group holds (up to a block of alignment)
Prints output tokens/s for both and the ratio; --json writes the rows. Our prefix cache is reset
before every run so repetitions never see an earlier run's blocks.

    python -m benchmarks.engine_throughput [--reps 3] [--threads 2] [--json out.json] [--ablate]
        [--cases 1,2,3,moe,sliding]

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
import tempfile
import time
from pathlib import Path

import torch

NEW = 64
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
             vocab_size=32000, max_position_embeddings=2048, init_std=0.02)


#: Qwen3-MoE-shaped (the 30B-A3B's routing: top-k renormalised, 1/16 of the experts at top 8 of 128; here top 4
#: of 32), tiny for CPU
MOE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
           intermediate_size=1408, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
           norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
           initializer_range=0.02)
#: Gemma-3-shaped: five sliding-window layers to one global, window 512, 8k context, one KV head of 64 (GQA 4)
SLIDING = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
               intermediate_size=1024, vocab_size=32000, max_position_embeddings=16384, sliding_window=512,
               layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=64,
               tie_word_embeddings=True, initializer_range=0.02)
SLIDING_CASE = (2, 8192, 16)                    # requests, prompt tokens, new tokens


def write_hf_checkpoint(path: str | Path, config_class: str, *, dtype: str = "float32", device: str = "cpu",
                        seed: int = 0, **config) -> Path:
    """A random checkpoint of any transformers architecture, written by transformers (hub tensor names), with
    the demo tokenizer; weights initialised on `device` (fast for large models on a GPU)."""
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from affinity_serve.engine.demo import build_tokenizer
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(str(path))
    ids = dict(bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("<|im_end|>"),
               pad_token_id=tok.token_to_id("<pad>"))
    cfg = getattr(transformers, config_class)(**ids, **config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(str(path))
    del model
    return path


def prompts(n: int, plen: int, prefix: int = 0, seed: int = 123) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pre = torch.randint(3, 32000, (prefix,), generator=g).tolist()
    return [pre + torch.randint(3, 32000, (plen,), generator=g).tolist() for _ in range(n)]


def run_hf(model, ps: list[list[int]], new: int = NEW) -> tuple[float, int]:
    ids = torch.tensor(ps)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t, len(ps) * new


def blocks_held(llm, ps: list[list[int]], new: int) -> dict:
    """One untimed run that records, at every step once every request decodes, the blocks each KV-cache group
    holds (over all requests); returns the most each group held then, with the groups' windows."""
    from affinity_serve.engine import SamplingParams
    eng = llm.engine
    kv = eng.kv_cache_manager
    assert eng.reset_prefix_cache()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, p in enumerate(ps):
        eng.add_request(eng.make_request(p, params, req_id=f"h{i}"))
    peak = [0] * len(kv.groups)
    while eng.has_unfinished_requests():
        eng.step()
        tables = list(kv.req_to_group_blocks.values())
        if len(tables) == len(ps) and all(r.num_output_tokens >= 1 for r in eng.scheduler.running):
            for g in range(len(kv.groups)):
                peak[g] = max(peak[g], sum(1 for t in tables for b in t[g] if not b.is_null))
    return {"windows": [g.window for g in kv.groups], "blocks": peak}


def model_case(key: str, tmp: str, threads: int, reps: int) -> list[dict]:
    """Case `moe` or `sliding`: a checkpoint of that shape, transformers and ours on it, interleaved."""
    from transformers import AutoModelForCausalLM

    from affinity_serve.engine import LLM
    if key == "moe":
        path = write_hf_checkpoint(Path(tmp) / "moe", "Qwen3MoeConfig", **MOE)
        name, ps, new = "MoE (Qwen3-MoE-shaped) 32 x 128 -> 64", prompts(32, 128), NEW
        engine_kw = dict(cache={"block_size": 16, "num_blocks": 2048},
                         scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 64})
    else:
        path = write_hf_checkpoint(Path(tmp) / "sliding", "Gemma3TextConfig", **SLIDING)
        n, plen, new = SLIDING_CASE
        name, ps = f"sliding window (Gemma-3-shaped) {n} x {plen} -> {new}", prompts(n, plen)
        # 2048-token chunks: a sliding group holds its window plus one chunk while a prompt is computed
        engine_kw = dict(cache={"block_size": 16, "num_blocks": 2 * 1024 + 256},
                         scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": 8})
    print(f"[engine_throughput] case {key}: {name}", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    llm = LLM(path, num_threads=threads, **engine_kw)
    run_hf(hf, prompts(2, 16), 4)
    run_ours(llm, prompts(2, 16), 4)
    if key == "moe":
        row = moe_rows(name, hf, llm, ps, new, reps)
        hf_s, torch_s = row["hf_s"], row["ours_torch_experts_s"]
        return [row, {"case": "  torch experts (grouped_experts)", "hf_tok_s": row["hf_tok_s"],
                      "ours_tok_s": round(len(ps) * new / torch_s, 1), "ratio": round(hf_s / torch_s, 2),
                      "vs_default": round(row["ours_s"] / torch_s, 2), "hf_s": hf_s, "ours_s": torch_s}]
    best = {"hf": float("inf"), "ours": float("inf")}
    for rep in range(reps):
        for who in best:
            dt, got = run_hf(hf, ps, new) if who == "hf" else run_ours(llm, ps, new)
            assert got == len(ps) * new
            best[who] = min(best[who], dt)
            print(f"[engine_throughput] case {key} rep {rep + 1}/{reps} {who}: {dt:.2f}s", flush=True)
    n = len(ps) * new
    row = {"case": name, "hf_tok_s": round(n / best["hf"], 1), "ours_tok_s": round(n / best["ours"], 1),
           "ratio": round(best["hf"] / best["ours"], 2), "vs_default": 1.0, "hf_s": round(best["hf"], 3),
           "ours_s": round(best["ours"], 3)}
    if key == "sliding":
        held = blocks_held(llm, ps, new)
        full = max(b for b, w in zip(held["blocks"], held["windows"]) if w is None)
        sliding = max(b for b, w in zip(held["blocks"], held["windows"]) if w is not None)
        window = SLIDING["sliding_window"]
        row.update(full_group_blocks=full, sliding_group_blocks=sliding,
                   sliding_over_full=round(sliding / full, 4), window_over_context=round(window / (plen + new), 4),
                   window_blocks_per_request=window // 16)
        print(f"[engine_throughput] blocks held while decoding: full-attention group {full}, each sliding group "
              f"<= {sliding} ({sliding / full:.3f} of full; window / context = {window / (plen + new):.3f})")
    del hf, llm
    return [row]


def weight_read_floor(hf, reps: int = 10) -> tuple[float, int]:
    """(seconds, bytes): the best of `reps` passes that read once every weight a decode step reads (all of
    transformers' parameters but the embedding table, whose rows a step gathers), each as a reduction."""
    ws = [p.detach() for n, p in hf.named_parameters() if "embed_tokens" not in n]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            for w in ws:
                w.sum()
            best = min(best, time.perf_counter() - t)
    return best, sum(w.numel() * w.element_size() for w in ws)


def moe_rows(name: str, hf, llm, ps: list[list[int]], new: int, reps: int) -> dict:
    """The MoE case: transformers, ours, and ours with the torch experts, each for `new` tokens and for 1
    (whose difference over new - 1 is the decode step), interleaved; plus the weight-read floor."""
    from affinity_serve.engine.models.moe import SparseMoE, grouped_experts
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    default_fn = moes[0].experts_fn

    def ours(fn):
        def go(ps, n):
            for m in moes:
                m.experts_fn = fn
            try:
                return run_ours(llm, ps, n)
            finally:
                for m in moes:
                    m.experts_fn = default_fn
        return go

    runs = {"hf": lambda ps, n: run_hf(hf, ps, n), "ours": ours(default_fn),
            "ours_torch_experts": ours(grouped_experts)}
    best = {(who, n): float("inf") for who in runs for n in (new, 1)}
    floor = float("inf")
    for rep in range(reps):
        for (who, n) in best:
            dt, got = runs[who](ps, n)
            assert got == len(ps) * n
            best[who, n] = min(best[who, n], dt)
            print(f"[engine_throughput] case moe rep {rep + 1}/{reps} {who} ({n} new): {dt:.2f}s", flush=True)
        floor_s, floor_bytes = weight_read_floor(hf)
        floor = min(floor, floor_s)
    tokens = len(ps) * new
    step = {who: (best[who, new] - best[who, 1]) / (new - 1) for who in runs}
    row = {"case": name, "hf_tok_s": round(tokens / best["hf", new], 1),
           "ours_tok_s": round(tokens / best["ours", new], 1), "ratio": round(best["hf", new] / best["ours", new], 2),
           "vs_default": 1.0, "hf_s": round(best["hf", new], 3), "ours_s": round(best["ours", new], 3),
           "ours_torch_experts_s": round(best["ours_torch_experts", new], 3),
           "ratio_torch_experts": round(best["hf", new] / best["ours_torch_experts", new], 2),
           "prefill_s": {who: round(best[who, 1], 3) for who in runs},
           "decode_step_ms": {who: round(step[who] * 1e3, 2) for who in runs},
           "floor_decode_step_ms": round(floor * 1e3, 2), "floor_weight_mb": round(floor_bytes / 1e6, 1),
           "floor_read_gb_s": round(floor_bytes / floor / 1e9, 1)}
    print(f"[engine_throughput] MoE decode step at batch {len(ps)}: transformers {step['hf'] * 1e3:.1f} ms, ours "
          f"{step['ours'] * 1e3:.1f} ms (torch experts {step['ours_torch_experts'] * 1e3:.1f} ms); weight-read floor "
          f"{floor * 1e3:.1f} ms ({floor_bytes / 1e6:.0f} MB at {floor_bytes / floor / 1e9:.1f} GB/s): transformers "
          f"{step['hf'] / floor:.1f}x the floor, ours {step['ours'] / floor:.1f}x. Prefill + 1 token: transformers "
          f"{best['hf', 1]:.2f} s, ours {best['ours', 1]:.2f} s (torch experts {best['ours_torch_experts', 1]:.2f} s)")
    return row


def run_ours(llm, ps: list[list[int]], new: int = NEW) -> tuple[float, int]:
    from affinity_serve.engine import SamplingParams
    assert llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cases", default="1,2,3,moe,sliding")
    ap.add_argument("--ablate", action="store_true", help="also run case 1 with our speed-ups switched off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from affinity_serve.engine import LLM
    from affinity_serve.engine.demo import write_demo_model

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

    from affinity_serve.engine.models.linear import HYBRID_PLAIN_ROWS, PackedLinear
    kernel, c_ops_impl = llm.engine.runner.backend.decode_kernel, llm.engine.runner.model.ops
    if not llm.engine.runner.model.fused:
        c_ops_impl = None
    rows = []
    for key in args.cases.split(","):
        if key in ("moe", "sliding"):
            rows += model_case(key, tmp, args.threads, args.reps)
            continue
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
    hdr = f"{'case':<44} {'transformers tok/s':>19} {'ours tok/s':>11} {'ratio':>6} {'vs default':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<44} {r['hf_tok_s']:>19.1f} {r['ours_tok_s']:>11.1f} {r['ratio']:>5.2f}x "
              f"{r['vs_default']:>9.2f}x")
    for r in rows:
        if "floor_decode_step_ms" in r:
            step = r["decode_step_ms"]
            floor = r["floor_decode_step_ms"]
            print(f"{r['case']}: decode step transformers {step['hf']:.1f} ms ({step['hf'] / floor:.1f}x the floor), "
                  f"ours {step['ours']:.1f} ms ({step['ours'] / floor:.1f}x); weight-read floor {floor:.1f} ms "
                  f"({r['floor_weight_mb']:.0f} MB at {r['floor_read_gb_s']:.1f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "reps": args.reps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
