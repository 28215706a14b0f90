"""GPU throughput: our engine vs transformers `generate` on the same GPU, in one process.

The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, vocab
128256, tied embeddings, llama3 RoPE) with random bf16 weights written on the machine (no download). Cases,
greedy, new tokens forced (no EOS), best of --reps, interleaved A/B:
  batch 1, 32 and 128 x 512-token prompts -> 128 new tokens; and 32 x (512 shared + 32 unique) -> 128,
  128 x (512 shared + 32) -> 128 and 128 x (2048 shared + 32) -> 128.
Reports output tokens/s for both, the ratio, and our decode step time (all sequences decoding, measured
over the steps after the last prefill) against the memory-bandwidth floor: the bytes one decode step must
read (every weight once, the lm_head included, plus each sequence's KV) over the device's copy bandwidth
measured in the same run ((read + write bytes) / time of a large device-to-device copy). The floor counts
each distinct KV page once: a shared prefix's pages (one copy, shared through the prefix cache) once, whether
or not cascade decode (the torch and triton backends' default for a shared prefix of 64 tokens or more)
reads them once; without it each request re-reads them, mostly from L2, and the step shows what that costs. With
overlap_decode on (the default with CUDA graphs), batch 1 and 32 also run
with it off, and with cascade decode the shared-prefix case also runs with it off, interleaved on the same
engine, as rows of their own.

    python -m benchmarks.engine_throughput_gpu [--backend auto|triton|torch|flash] [--enforce-eager] [--reps 2]
        [--case TEXT] [--json out.json]
    python -m benchmarks.engine_throughput_gpu --device cpu --tiny          # smoke-tests the script on CPU

Targets (issue 12): >= 2x transformers at batch 32, >= 1.2x at batch 1, decode step at batch 1 within 2x of
the bandwidth floor.

Two more model families (issue 31), each on its own checkpoint written by transformers, ours vs transformers
on it in the same run:
  MoE: Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, top 8 renormalised, 32 / 4 heads of 128) with
      --moe-layers of its 48 layers (12: ~7.6B parameters, so both copies fit an 80 GB GPU); batch 1 and 32 x
      512 -> 128. Its floor reads the experts a step activates only: E x (1 - (1 - k/E)^B) per layer for B
      sequences under uniform routing (random weights route near-uniformly), plus every other weight.
  sliding: Gemma-3-1B-shaped (hidden 1152, 26 layers, five sliding (window 512) to one global, 4 / 1 heads of
      256), 4 x 8192 -> 64: also the KV blocks each KV-cache group holds while decoding (a sliding group holds
      about window / context of the full group's). Its floor reads min(context, window) keys in sliding layers.
They run when --case selects them (--case MoE, --case sliding) or with --all; without either, only the Llama
cases run (make bench-gpu stays about a minute). --tiny has small ones of each.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                init_std=0.02)
TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=1024,
            max_position_embeddings=2048, tie_word_embeddings=True, init_std=0.02)


#: the MoE and sliding-window families: (transformers config class, its arguments); --tiny ones for CPU smoke tests
QWEN3_A3B = ("Qwen3MoeConfig", dict(
    hidden_size=2048, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
    initializer_range=0.02))
GEMMA3_1B = ("Gemma3TextConfig", dict(
    hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
    query_pre_attn_scalar=256, tie_word_embeddings=True, initializer_range=0.02))
TINY_MOE = ("Qwen3MoeConfig", dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.02))
TINY_SLIDING = ("Gemma3TextConfig", dict(
    hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    intermediate_size=256, vocab_size=1024, max_position_embeddings=4096, sliding_window=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=32,
    tie_word_embeddings=True, initializer_range=0.02))


def family(name: str) -> str:
    """Which model a case runs on: 'llama' (the default model), 'moe' or 'sliding'."""
    return "moe" if name.startswith("MoE") else "sliding" if name.startswith("sliding") else "llama"


def cases(tiny: bool) -> list[tuple[str, int, int, int, int]]:
    """(name, batch, shared prefix, prompt tokens after it, new tokens)."""
    if tiny:
        return [("batch 1, 32 -> 8", 1, 0, 32, 8), ("batch 4, 32 -> 8", 4, 0, 32, 8),
                ("4 x (64 shared + 8) -> 8", 4, 64, 8, 8), ("MoE batch 4, 32 -> 8", 4, 0, 32, 8),
                ("sliding batch 2, 200 -> 8", 2, 0, 200, 8)]
    return [("MoE batch 1, 512 -> 128", 1, 0, 512, 128), ("MoE batch 32, 512 -> 128", 32, 0, 512, 128),
            ("sliding batch 4, 8192 -> 64", 4, 0, 8192, 64),
            ("batch 1, 512 -> 128", 1, 0, 512, 128), ("batch 32, 512 -> 128", 32, 0, 512, 128),
            ("batch 128, 512 -> 128", 128, 0, 512, 128), ("32 x (512 shared + 32) -> 128", 32, 512, 32, 128),
            ("128 x (512 shared + 32) -> 128", 128, 512, 32, 128),
            ("128 x (2048 shared + 32) -> 128", 128, 2048, 32, 128)]


def prompts(n: int, plen: int, prefix: int, vocab: int, seed: int = 123) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pre = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    return [pre + torch.randint(3, vocab, (plen,), generator=g).tolist() for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """(read + write) bytes per second of a device-to-device copy of `nbytes`, best of 5."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best


def run_hf(model, ps: list[list[int]], new: int, device: torch.device) -> float:
    ids = torch.tensor(ps, device=device)
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t


def run_ours(llm, ps: list[list[int]], new: int) -> tuple[float, float, int]:
    """(total seconds, mean decode step seconds once every sequence decodes, decode steps measured)."""
    from affinity_serve.engine import SamplingParams
    eng = llm.engine
    assert eng.reset_prefix_cache()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        eng.add_request(eng.make_request(p, params, req_id=f"b{i}"))
    produced = {f"b{i}": 0 for i in range(len(ps))}
    decode_t, decode_steps = 0.0, 0
    while eng.has_unfinished_requests():
        all_decoding = all(n >= 1 for n in produced.values())
        t = time.perf_counter()
        out = eng.step()
        dt = time.perf_counter() - t                        # the step returns sampled ids to the host: synced
        for d in out.deltas:
            produced[d.req_id] += len(d.token_ids)
        if all_decoding and out.deltas and all(len(d.token_ids) == 1 for d in out.deltas):
            decode_t += dt
            decode_steps += 1
    total = time.perf_counter() - t0
    assert all(n == new for n in produced.values()), produced
    return total, decode_t / max(decode_steps, 1), decode_steps


def cascade_count(runner) -> int:
    """Steps (graph replays) and eager forwards that ran cascade decode so far."""
    graphs = runner.decode_graphs
    return getattr(runner.backend, "num_cascade_forwards", 0) + (graphs.num_cascade_steps if graphs else 0)


def floor_bytes(model: torch.nn.Module, cfg: dict, contexts: list[int], elem: int, *,
                active_experts: float | None = None, layer_windows: list[int | None] | None = None) -> int:
    """Bytes one decode step must read: every parameter once (a tied embedding is read once, as the lm_head;
    the embedding lookup itself reads a row per sequence) plus each sequence's K and V. MoE (`active_experts`:
    experts a step activates per layer): only those experts' weights. `layer_windows`: a sliding layer reads
    at most its window of each sequence's keys."""
    unique = {id(p): (name, p) for name, p in model.named_parameters()}.values()
    params = 0.0
    for name, p in unique:
        if active_experts is not None and "experts" in name.split("."):     # [E, ...]: the active share
            params += p.numel() * active_experts / p.shape[0]
        else:
            params += p.numel()
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_heads"]
    windows = layer_windows if layer_windows is not None else [None] * cfg["num_layers"]
    keys = sum(sum(c if w is None else min(c, w) for c in contexts) for w in windows)
    kv = keys * 2 * cfg["num_kv_heads"] * head_dim
    return int((params + kv) * elem)


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts `batch` tokens pick under uniform top-k routing: E (1 - (1 - k/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def load_family(fam: str, args, tmp: str, device: torch.device, dt: torch.dtype, say):
    """(checkpoint path, our cfg dict for the floor, MoE (E, k) or None, layer windows or None) for one family."""
    from benchmarks.engine_throughput import write_hf_checkpoint
    from affinity_serve.engine.demo import write_demo_model
    if fam == "llama":
        cfg = TINY if args.tiny else LLAMA_1B
        say(f"writing the {'tiny' if args.tiny else 'Llama-3.2-1B-shaped'} model ({args.dtype}) to {tmp} ...")
        return write_demo_model(Path(tmp) / "llama", dtype=args.dtype, **cfg), cfg, None, None
    cls, hf_cfg = (TINY_MOE if args.tiny else QWEN3_A3B) if fam == "moe" else (TINY_SLIDING if args.tiny else GEMMA3_1B)
    hf_cfg = dict(hf_cfg)
    if fam == "moe" and not args.tiny:
        hf_cfg["num_hidden_layers"] = args.moe_layers
    say(f"writing the {fam} model ({cls}, {hf_cfg['num_hidden_layers']} layers, {args.dtype}) ...")
    path = write_hf_checkpoint(Path(tmp) / fam, cls, dtype=args.dtype, device=str(device), **hf_cfg)
    cfg = dict(hidden_size=hf_cfg["hidden_size"], num_layers=hf_cfg["num_hidden_layers"],
               num_heads=hf_cfg["num_attention_heads"], num_kv_heads=hf_cfg["num_key_value_heads"],
               head_dim=hf_cfg["head_dim"], vocab_size=hf_cfg["vocab_size"])
    moe = (hf_cfg["num_experts"], hf_cfg["num_experts_per_tok"]) if fam == "moe" else None
    windows = None
    if fam == "sliding":
        from affinity_serve.engine.models.config import ModelArgs
        windows = list(ModelArgs.from_dir(path).layer_windows)
    return path, cfg, moe, windows


def blocks_held(llm, ps: list[list[int]], new: int) -> list[tuple[int | None, int]]:
    """(window, most blocks held) per KV-cache group over the steps where every request decodes (one untimed run,
    the CPU benchmark's measurement)."""
    from benchmarks.engine_throughput import blocks_held as held_per_group
    held = held_per_group(llm, ps, new)
    return list(zip(held["windows"], held["blocks"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default="auto", help="our attention_backend: auto | triton | torch | flash")
    ap.add_argument("--enforce-eager", action="store_true", help="ours without CUDA-graph decode")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short cases (smoke test)")
    ap.add_argument("--kv-budget-gib", type=float, default=16.0, help="our KV pool (transformers needs the rest)")
    ap.add_argument("--moe-layers", type=int, default=12,
                    help="layers of the A3B-shaped MoE model (48 in the real one)")
    ap.add_argument("--case", action="append", default=[], metavar="TEXT",
                    help="only the cases whose name contains TEXT (repeatable; e.g. --case shared)")
    ap.add_argument("--all", action="store_true", help="also the MoE and sliding-window families")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny to check the script")
    names = [c[0] for c in cases(args.tiny)]
    if args.case and not any(t in n for n in names for t in args.case):
        sys.exit(f"--case {' / '.join(args.case)} matches none of the cases: {names}")
    selected = [c for c in cases(args.tiny)
                if (any(t in c[0] for t in args.case) if args.case else args.all or family(c[0]) == "llama")]
    dt = getattr(torch, args.dtype)
    say = lambda msg: print(f"[engine_throughput_gpu] {msg}", flush=True)  # noqa: E731
    bw = copy_bandwidth(device, 64 * 2 ** 20 if args.tiny else 2 * 2 ** 30)
    say(f"device copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    rows, info = [], {}
    with tempfile.TemporaryDirectory(prefix="affinity-gpu-bench-") as tmp:     # the generated models
        for fam in ("llama", "moe", "sliding"):
            fam_cases = [c for c in selected if family(c[0]) == fam]
            if fam_cases:
                rows += run_family(fam, fam_cases, args, tmp, device, dt, bw, say, info)
    hdr = (f"{'case':<44} {'transformers tok/s':>19} {'ours tok/s':>11} {'ratio':>6} {'step ms':>8} "
           f"{'floor ms':>9} {'step/floor':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<44} {r['hf_tok_s']:>19.1f} {r['ours_tok_s']:>11.1f} {r['ratio']:>5.2f}x "
              f"{r['decode_step_ms']:>8.2f} {r['floor_ms']:>9.2f} {r['step_over_floor']:>9.2f}x")
        if "blocks_held" in r:
            held = ", ".join(f"{'full' if w is None else f'window {w}'}: {n}" for w, n in r["blocks_held"])
            print(f"  KV blocks held while decoding, per group: {held}")
    if args.json:
        dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": dev_name, "dtype": args.dtype, **info,
                                         "copy_bandwidth_gb_s": round(bw / 1e9, 1),
                                         "reps": args.reps,
                                         "torch": torch.__version__, "rows": rows}, indent=2))


def run_family(fam: str, fam_cases: list, args, tmp: str, device: torch.device, dt: torch.dtype, bw: float, say,
               info: dict) -> list[dict]:
    """Write one family's model, load transformers and ours on it, run its cases interleaved."""
    from transformers import AutoModelForCausalLM

    from affinity_serve.engine import LLM
    path, cfg, moe, windows = load_family(fam, args, tmp, device, dt, say)
    say("loading transformers ...")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dt).to(device).eval()
    if hf.dtype != dt:                          # an old transformers ignores `dtype=` (it was torch_dtype)
        sys.exit(f"transformers loaded the model in {hf.dtype}, not {dt}: the comparison would not be fair")
    say(f"loading ours (attention_backend={args.backend}) ...")
    llm = LLM(path, device=args.device, dtype=args.dtype, attention_backend=args.backend,
              enforce_eager=args.enforce_eager,
              cache={"block_size": 16, "memory_budget_bytes": int(args.kv_budget_gib * 2 ** 30)},
              scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 256})
    runner = llm.engine.runner
    backend = runner.backend.name
    graphs = runner.decode_graphs is not None
    say(f"{fam}: backend {backend}, CUDA-graph decode {'on' if graphs else 'off'}")
    if fam == "llama":
        info.update(backend=backend, cuda_graphs=graphs)
    say("warming up ...")
    warm = prompts(2, 16, 0, cfg["vocab_size"])
    run_hf(hf, warm, 4, device)
    run_ours(llm, warm, 4)
    overlap = runner.overlap_decode
    least = getattr(runner.backend, "cascade_min_tokens", None)            # cascade decode (triton backend)
    if fam == "llama":
        info.update(overlap_decode=overlap, cascade_min_tokens=least)
    say(f"overlap_decode {'on' if overlap else 'off'}; cascade decode "
        f"{f'from {least} shared tokens' if least is not None else 'off'}")
    rows = []
    for name, batch, prefix, plen, new in fam_cases:
        ps = prompts(batch, plen, prefix, cfg["vocab_size"])
        cascade = least is not None and batch > 1 and prefix // 16 * 16 >= least
        # on the same engine, interleaved: batch 1 and 32 with overlap_decode also run in order (the switch
        # off), and a shared prefix read in cascade also runs without: what each buys
        variants = [(name, overlap, cascade)]
        if overlap and batch in (1, 32) and not prefix and fam == "llama":
            variants.append((f"{name}, in order", False, cascade))
        if cascade:
            variants.append((f"{name}, no cascade", overlap, False))
        best = {v: [float("inf")] * 3 for v, _, _ in variants}          # transformers s, ours s, step s
        cascaded = {v: False for v, _, _ in variants}                   # whether a step actually ran in cascade
        for rep in range(args.reps):
            t_hf = run_hf(hf, ps, new, device)
            for v, ov, casc in variants:
                runner.overlap_decode = ov
                if least is not None:
                    runner.backend.cascade_min_tokens = least if casc else None
                before = cascade_count(runner)
                t_ours, t_step, n_steps = run_ours(llm, ps, new)
                cascaded[v] |= cascade_count(runner) > before
                b = best[v]
                best[v] = [min(b[0], t_hf), min(b[1], t_ours), min(b[2], t_step)]
                say(f"{v} rep {rep + 1}/{args.reps}: transformers {t_hf:.2f}s, ours {t_ours:.2f}s "
                    f"(decode step {t_step * 1e3:.2f} ms over {n_steps} steps)")
            runner.overlap_decode = overlap
            if least is not None:
                runner.backend.cascade_min_tokens = least
        n = batch * new
        active = expected_active_experts(moe[0], moe[1], batch) if moe else None
        for v, ov, _ in variants:
            # the floor at the mean context of the measured decode steps (prompt + half the new tokens), each
            # distinct page once: the whole blocks of a shared prefix are one copy in the cache
            casc = cascaded[v]
            shared = prefix // 16 * 16
            ctx = ([shared] if shared else []) + [prefix - shared + plen + new // 2] * batch
            floor = floor_bytes(runner.model, cfg, ctx, dt.itemsize, active_experts=active,
                                layer_windows=windows) / bw
            best_hf, best_ours, step = best[v]
            row = {"case": v, "hf_tok_s": round(n / best_hf, 1), "ours_tok_s": round(n / best_ours, 1),
                   "ratio": round(best_hf / best_ours, 2), "decode_step_ms": round(step * 1e3, 5),
                   "floor_ms": round(floor * 1e3, 5), "step_over_floor": round(step / floor, 2),
                   "overlap_decode": ov, "cascade": casc, "backend": backend}
            if active is not None:
                row["active_experts_per_layer"] = round(active, 1)
            if windows is not None:
                row["blocks_held"] = blocks_held(llm, ps, new)
            rows.append(row)
    del hf, llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
