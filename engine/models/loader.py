"""Load a Llama-family model from a local Hugging Face checkpoint directory (safetensors only)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.models.checkpoint import safetensors_files
from engine.models.config import ModelArgs
from engine.models.llama import LlamaForCausalLM
from engine.models.rope import cos_sin_table

logger = logging.getLogger(__name__)

# checkpoint name suffix -> (our parameter suffix, slice index within the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


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
        model = LlamaForCausalLM(args, max_positions)
    model = model.to_empty(device=device).to(dtype)     # uninitialised storage in the target dtype
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    sizes = {"q": args.num_heads * args.head_dim, "kv": args.num_kv_heads * args.head_dim}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                _load_one(name, f, params, loaded, sizes, args, dtype)
    if args.tie_word_embeddings or "lm_head.weight" not in loaded:
        if "lm_head.weight" not in loaded and not args.tie_word_embeddings:
            raise ModelLoadError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    cos, sin = cos_sin_table(args.rope, args.head_dim, max_positions)   # were on meta; float32 always
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.prepare_for_inference(prepack, plain_rows)
    return model.eval(), args


def _load_one(name: str, f, params: dict, loaded: set[str], sizes: dict, args: ModelArgs,
              dtype: torch.dtype) -> None:
    if "rotary_emb.inv_freq" in name:
        return
    ours = name.removeprefix("model.")
    for ckpt, (fused, idx) in _FUSED.items():
        marker = f".{ckpt}."
        if marker in ours:
            target_name = ours.replace(marker, f".{fused}.")
            param = params.get(target_name)
            if param is None:
                raise ModelLoadError(f"unexpected checkpoint tensor {name!r}")
            t = f.get_tensor(name)
            if fused.endswith("qkv_proj"):
                offs = [0, sizes["q"], sizes["q"] + sizes["kv"], sizes["q"] + 2 * sizes["kv"]]
            else:
                offs = [0, args.intermediate_size, 2 * args.intermediate_size]
            rows = slice(offs[idx], offs[idx + 1])
            _copy(param, rows, t, name)
            loaded.add(f"{target_name}#{idx}")
            parts = 3 if fused.endswith("qkv_proj") else 2
            if all(f"{target_name}#{i}" in loaded for i in range(parts)):
                loaded.add(target_name)
            return
    param = params.get(ours)
    if param is None:
        logger.debug("ignoring checkpoint tensor %s", name)
        return
    _copy(param, slice(None), f.get_tensor(name), name)
    loaded.add(ours)


def _copy(param: torch.nn.Parameter, rows: slice, t: torch.Tensor, name: str) -> None:
    dst = param.data[rows]
    if dst.shape != t.shape:
        raise ModelLoadError(f"shape mismatch for {name}: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(t.to(dst.dtype))
