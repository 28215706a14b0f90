"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases per qkv_bias) and a sparse-MoE
block with a shared expert, gated by sigmoid(shared_expert_gate(x)), that every token goes through."""
from typing import Any

from affinity_serve.engine.models.arch.qwen3 import moe_layers
from affinity_serve.engine.models.config import MoESpec
from affinity_serve.engine.models.registry import ArchSpec


def _qwen2_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    experts, layers = moe_layers(cfg)
    bias = bool(cfg.get("qkv_bias", True))
    return {"moe": MoESpec(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                           bool(cfg.get("norm_topk_prob", False)), layers,
                           shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0),
            "qkv_bias": bias, "o_bias": False}


SPECS = [
    ArchSpec("Qwen2MoeForCausalLM", moe=True, sliding_window_default=False, parse=_qwen2_moe,
             defaults=(("max_position_embeddings", 32768),),
             implemented_fields=frozenset({"shared_expert_intermediate_size"})),
]
