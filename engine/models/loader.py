"""Load a decoder model from a local Hugging Face checkpoint directory (safetensors only), and check a
checkpoint's tensors against the model before anything loads (`plan_weights`, `check_weight_shapes`): each
tensor must have a place of its shape in the model, and each parameter a tensor.

Checkpoint names map onto ours in one place, `_locate`: the architecture's renames (engine/models/registry.py),
then q/k/v into the fused qkv_proj, gate/up into gate_up_proj, and per-expert MoE weights
(`mlp.experts.E.gate_proj` ...) into the stacked expert tensors. Checkpoints that store these fused already
(Phi-3's qkv_proj and gate_up_proj, transformers 5's stacked experts) match our names directly.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.checkpoint import safetensors_files
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.llama import LlamaForCausalLM
from affinity_serve.engine.models.registry import architectures, model_class

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = re.compile(r"\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"\.mlp(\.shared_expert)?\.(gate|up)_proj\.(weight|bias)$")

#: a parameter and where in it a checkpoint tensor goes (an expert index and/or a row slice)
Target = tuple[str, tuple]


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, *, prepack: bool = False,
               plain_rows: int = 0) -> tuple[LlamaForCausalLM, ModelArgs]:
    """Build the model on the meta device, then stream tensors from the shards into real storage.

    The checkpoint's headers are checked first, as the pre-flight check does (`plan_weights`).
    `prepack`: reorder the Linear weights for oneDNN afterwards (CPU; see engine/models/linear.py), keeping
    the plain weights too for inputs of at most `plain_rows` rows.
    """
    path = Path(path)
    args = ModelArgs.from_dir(path)
    with torch.device("meta"):
        model = model_class(architectures()[args.architecture])(args, max_positions)
    plan = plan_weights(path, args, dict(model.named_parameters()))
    model = model.to_empty(device=device).to(dtype)     # uninitialised storage in the target dtype
    params = dict(model.named_parameters())
    for file, entries in plan:
        with _open(file) as f:
            for name, (pname, index) in entries:
                try:
                    t = f.get_tensor(name)
                except Exception as e:       # safetensors' SafetensorError: a file cut short or corrupt
                    raise _unreadable(file, e) from None
                with torch.no_grad():
                    params[pname].data[index].copy_(t.to(dtype))
    if args.tie_word_embeddings:
        head, embed = params["lm_head.weight"].data, params["embed_tokens.weight"].data
        if _ships_lm_head(plan) and not torch.equal(head, embed):
            raise _untied_head_error()
        model.tie_weights()
    model.init_rope(max_positions, device)          # the tables were on meta; float32 always
    model.prepare_for_inference(prepack, plain_rows)
    return model.eval(), args


def check_weight_shapes(path: str | Path, args: ModelArgs) -> None:
    """The pre-flight check of the weights (`plan_weights`: names, shapes, what is missing, from the
    safetensors headers, the model built on the meta device), plus, for a tied model whose checkpoint
    ships an lm_head.weight anyway, that it equals the embeddings (those two tensors are read)."""
    path = Path(path)
    with torch.device("meta"):
        model = model_class(architectures()[args.architecture])(args, 1)
    plan = plan_weights(path, args, dict(model.named_parameters()))
    if args.tie_word_embeddings and _ships_lm_head(plan):
        found = {pname: (file, name) for file, entries in plan for name, (pname, index) in entries if index == ()}
        if "embed_tokens.weight" in found and not torch.equal(*(_read(*found[p]) for p in
                                                               ("lm_head.weight", "embed_tokens.weight"))):
            raise _untied_head_error()


#: checkpoint tensors no parameter takes that change nothing: the RoPE inverse frequencies older
#: checkpoints saved as buffers (the model computes its own tables)
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def plan_weights(path: Path, args: ModelArgs, params: dict) -> list[tuple[Path, list[tuple[str, Target]]]]:
    """Each weight file's tensors and where each goes, from the safetensors headers alone. ModelLoadError,
    in one line, for a file that cannot be read, a tensor no parameter takes (another architecture's, a
    quantized checkpoint's scales), a shape that differs, and a parameter the checkpoint does not fill
    (config.json asks for more layers, biases, an untied lm_head than the file has)."""
    plan = []
    covered: dict[str, int] = {}
    for file in safetensors_files(path):
        entries = []
        with _open(file) as f:
            for name in f.keys():
                if _HARMLESS.search(name):
                    continue
                target = _locate(name, params, args)
                if target is None:
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} has no place in {args.architecture} as config.json describes "
                        f"it (a layer or norm the config does not have, another architecture's weight, a quantized "
                        f"checkpoint's scale?); refusing rather than computing without it")
                pname, index = target
                try:
                    shape = tuple(f.get_slice(name).get_shape())
                except Exception as e:
                    raise _unreadable(file, e) from None
                _check_shape(name, shape, tuple(params[pname][index].shape))
                covered[pname] = covered.get(pname, 0) + params[pname][index].numel()
                entries.append((name, target))
        plan.append((file, entries))
    if args.tie_word_embeddings:
        covered["lm_head.weight"] = params["lm_head.weight"].numel()
    elif not covered.get("lm_head.weight"):
        raise ModelLoadError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    missing = [n for n, p in params.items() if covered.get(n, 0) < p.numel()]
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights config.json asks for ({len(missing)}: "
                             f"{', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}); check "
                             f"num_hidden_layers, attention_bias, mlp_bias and the other sizes against the files")
    return plan


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:           # SafetensorError: a header cut short or not JSON; OSError
        raise _unreadable(file, e) from None


def _unreadable(file: Path, e: Exception) -> ModelLoadError:
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ModelLoadError(f"cannot read weight file {file.name!r} in {str(file.parent)!r} ({why}): a truncated "
                          f"or corrupt download? Fetch it again")


def _read(file: Path, name: str) -> torch.Tensor:
    with _open(file) as f:
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise _unreadable(file, e) from None


def _ships_lm_head(plan) -> bool:
    return any(target[0] == "lm_head.weight" for _, entries in plan for _, target in entries)


def _untied_head_error() -> ModelLoadError:
    return ModelLoadError("config.json's tie_word_embeddings is true but the checkpoint's lm_head.weight differs "
                          "from the embeddings: set tie_word_embeddings to false to use that lm_head")


def _locate(name: str, params: dict, args: ModelArgs) -> Target | None:
    """Where checkpoint tensor `name` goes, or None for a tensor no parameter takes."""
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
    if target is not None and target[0] not in params:
        raise ModelLoadError(f"unexpected checkpoint tensor {name!r} for {args.architecture}")
    return target


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ModelLoadError(f"shape mismatch for {name}: checkpoint {got} vs model {want} "
                             f"(config.json does not describe these weights)")
