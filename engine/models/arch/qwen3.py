"""Qwen3 (dense: per-head q/k RMSNorm, no q/k/v bias) and Qwen3-MoE (the same attention, a sparse-MoE block
in the layers decoder_sparse_step and mlp_only_layers select; top-k renormalised per norm_topk_prob)."""
from typing import Any

from affinity_serve.engine.models.config import MoESpec
from affinity_serve.engine.models.registry import ArchSpec


def moe_layers(cfg: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """(number of experts, the layers with a sparse-MoE block): every decoder_sparse_step-th layer not in
    mlp_only_layers (Qwen2-MoE and Qwen3-MoE share the rule)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0   # the hub's name, transformers 5's
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return experts, tuple(i for i in range(cfg["num_hidden_layers"])
                          if i not in dense and experts > 0 and (i + 1) % step == 0)


def _moe(cfg: dict[str, Any]) -> dict[str, Any]:
    experts, layers = moe_layers(cfg)
    return {"moe": MoESpec(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                           bool(cfg.get("norm_topk_prob", False)), layers)}


SPECS = [
    ArchSpec("Qwen3ForCausalLM", qk_norm=True, sliding_window_default=False,
             defaults=(("max_position_embeddings", 32768),)),
    ArchSpec("Qwen3MoeForCausalLM", qk_norm=True, moe=True, sliding_window_default=False, parse=_moe,
             defaults=(("max_position_embeddings", 32768),)),
]
