"""Gemma 3 (text, Gemma3ForCausalLM): (1 + w) RMSNorm before and after attention and MLP, per-head q/k norm,
embeddings scaled by sqrt(hidden), GELU-tanh, query_pre_attn_scalar, and interleaved sliding-window and
global layers with their own RoPE (local base; global base and scaling). The sliding layers form their own
KV-cache groups, which keep only their window's blocks (engine/kv_cache_manager.py)."""
from typing import Any

from affinity_serve.engine.models.config import _rope_spec
from affinity_serve.engine.models.registry import ArchSpec


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:                              # older configs: every sliding_window_pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type or "sliding_attention" in per_type:      # transformers 5: one entry per type
        global_cfg = {"rope_parameters": per_type.get("full_attention") or {}}
        local_cfg = {"rope_parameters": per_type.get("sliding_attention") or {}}
    else:                                          # rope_theta + rope_scaling (global), rope_local_base_freq
        global_cfg = cfg
        local_cfg = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"rope": _rope_spec(global_cfg, SPECS[0]), "local_rope": _rope_spec(local_cfg, SPECS[0]),
            "sliding_layers": sliding, "sliding_window": cfg.get("sliding_window") if sliding else None,
            "attn_scale": cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
            "final_logit_softcapping": cfg.get("final_logit_softcapping")}


SPECS = [
    ArchSpec("Gemma3ForCausalLM", qk_norm=True, activations=("gelu_pytorch_tanh",), parse=_gemma3,
             tie_word_embeddings=True,
             defaults=(("max_position_embeddings", 131072), ("sliding_window", 4096), ("query_pre_attn_scalar", 256),
                       ("rope_theta", 1000000.0), ("rope_local_base_freq", 10000.0),
                       ("hidden_activation", "gelu_pytorch_tanh")),
             model="affinity_serve.engine.models.gemma3:Gemma3ForCausalLM",
             implemented_fields=frozenset({"query_pre_attn_scalar", "final_logit_softcapping"})),
]
