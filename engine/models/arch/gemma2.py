"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's decoder (engine/models/gemma3.py) without the per-head q/k norm,
with the attention scores soft-capped (attn_logit_softcapping) as well as the final logits, one RoPE for
every layer, and sliding-window and global layers alternating (sliding first), each kept by its KV-cache
group (engine/kv_groups.py)."""
from typing import Any

from affinity_serve.engine.models.config import _rope_spec
from affinity_serve.engine.models.registry import ArchSpec


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = cfg.get("sliding_window")
    return {"rope": _rope_spec(cfg, SPECS[0]), "sliding_layers": sliding if window else (),
            "sliding_window": window if sliding else None,
            "attn_scale": cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "attn_logit_softcapping": cfg.get("attn_logit_softcapping")}


SPECS = [
    ArchSpec("Gemma2ForCausalLM", activations=("gelu_pytorch_tanh",), parse=_gemma2, tie_word_embeddings=True,
             defaults=(("max_position_embeddings", 8192), ("sliding_window", 4096), ("query_pre_attn_scalar", 256),
                       ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("hidden_activation", "gelu_pytorch_tanh")),
             model="affinity_serve.engine.models.gemma3:Gemma3ForCausalLM",
             implemented_fields=frozenset({"query_pre_attn_scalar", "final_logit_softcapping",
                                           "attn_logit_softcapping"})),
]
