"""Load a decoder model from a local Hugging Face checkpoint directory (safetensors only), and check a
checkpoint's tensor shapes against the model before anything loads (`check_weight_shapes`).

Checkpoint names map onto ours in one place, `_locate`: the architecture's renames (engine/models/registry.py),
then q/k/v into the fused qkv_proj, gate/up into gate_up_proj, and per-expert MoE weights
(`mlp.experts.E.gate_proj` ...) into the stacked expert tensors. Checkpoints that store these fused already
(Phi-3's qkv_proj and gate_up_proj, transformers 5's stacked experts) match our names directly.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.checkpoint import safetensors_files
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.llama import LlamaForCausalLM
from affinity_serve.engine.models.registry import architectures, model_class

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = re.compile(r"\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"\.mlp(\.shared_expert)?\.(gate|up)_proj\.(weight|bias)$")

#: a parameter and where in it a checkpoint tensor goes (an expert index and/or a row slice)
Target = tuple[str, tuple]


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, *, prepack: bool = False,
               plain_rows: int = 0) -> tuple[LlamaForCausalLM, ModelArgs]:
    """Build the model on the meta device, then stream tensors from the shards into real storage.

    `prepack`: reorder the Linear weights for oneDNN afterwards (CPU; see engine/models/linear.py), keeping
    the plain weights too for inputs of at most `plain_rows` rows.
    """
    path = Path(path)
    args = ModelArgs.from_dir(path)
    files = safetensors_files(path)
    with torch.device("meta"):
        model = model_class(architectures()[args.architecture])(args, max_positions)
    model = model.to_empty(device=device).to(dtype)     # uninitialised storage in the target dtype
    params = dict(model.named_parameters())
    covered: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _locate(name, params, args)
                if target is None:
                    continue
                pname, index = target
                dst = params[pname].data[index]
                t = f.get_tensor(name)
                _check_shape(name, tuple(t.shape), tuple(dst.shape))
                with torch.no_grad():
                    dst.copy_(t.to(dst.dtype))
                covered[pname] = covered.get(pname, 0) + dst.numel()
    _tie_or_require_lm_head(model, args, params, covered)
    missing = sorted(n for n, p in params.items() if covered.get(n, 0) < p.numel())
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    model.init_rope(max_positions, device)          # the tables were on meta; float32 always
    model.prepare_for_inference(prepack, plain_rows)
    return model.eval(), args


def check_weight_shapes(path: str | Path, args: ModelArgs) -> None:
    """Every checkpoint tensor's shape against the model's, from the safetensors headers only (no weights
    read, the model built on the meta device): ModelLoadError naming the first tensor that differs."""
    path = Path(path)
    with torch.device("meta"):
        model = model_class(architectures()[args.architecture])(args, 1)
    params = dict(model.named_parameters())
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _locate(name, params, args)
                if target is not None:
                    pname, index = target
                    _check_shape(name, tuple(f.get_slice(name).get_shape()), tuple(params[pname][index].shape))


def _tie_or_require_lm_head(model: LlamaForCausalLM, args: ModelArgs, params: dict, covered: dict) -> None:
    has_head = covered.get("lm_head.weight", 0) == params["lm_head.weight"].numel()
    if args.tie_word_embeddings or not has_head:
        if not has_head and not args.tie_word_embeddings:
            raise ModelLoadError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        model.tie_weights()
        covered["lm_head.weight"] = params["lm_head.weight"].numel()


def _locate(name: str, params: dict, args: ModelArgs) -> Target | None:
    """Where checkpoint tensor `name` goes, or None for a tensor we do not use (logged at debug)."""
    if "rotary_emb.inv_freq" in name:
        return None
    ours = name.removeprefix("model.")
    for old, new in architectures()[args.architecture].renames:
        ours = ours.replace(old, new)
    target: Target | None = None
    if m := _EXPERT.search(ours):
        expert, proj = int(m.group(1)), m.group(2)
        num_experts = args.moe.num_experts if args.moe is not None else 0
        if expert >= num_experts:
            raise ModelLoadError(f"unexpected checkpoint tensor {name!r}: expert {expert}, but config.json "
                                 f"says {num_experts} experts")
        base = ours[:m.start()] + ".mlp.experts."
        inter = args.moe.intermediate_size if args.moe is not None else 0
        if proj == "down_proj":
            target = (base + "down_proj", (expert,))
        else:
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            target = (base + "gate_up_proj", (expert, rows))
    elif m := _QKV.search(ours):
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        start = {"q": 0, "k": q, "v": q + kv}[m.group(1)]
        size = q if m.group(1) == "q" else kv
        target = (ours[:m.start()] + f".self_attn.qkv_proj.{m.group(2)}", (slice(start, start + size),))
    elif m := _GATE_UP.search(ours):
        shared = m.group(1) or ""
        inter = args.moe.shared_intermediate_size if shared else args.intermediate_size
        rows = slice(0, inter) if m.group(2) == "gate" else slice(inter, 2 * inter)
        target = (ours[:m.start()] + f".mlp{shared}.gate_up_proj.{m.group(3)}", (rows,))
    elif ours in params:
        target = (ours, ())
    if target is None:
        logger.debug("ignoring checkpoint tensor %s", name)
    elif target[0] not in params:
        raise ModelLoadError(f"unexpected checkpoint tensor {name!r} for {args.architecture}")
    return target


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ModelLoadError(f"shape mismatch for {name}: checkpoint {got} vs model {want} "
                             f"(config.json does not describe these weights)")
