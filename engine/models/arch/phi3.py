"""Phi-3 (and Phi-4-mini): checkpoints store qkv_proj and gate_up_proj fused already, as the decoder does;
LongRoPE ("su" and "yarn" read as longrope, as transformers does) and a partial rotary factor."""
from affinity_serve.engine.models.registry import ArchSpec

SPECS = [
    ArchSpec("Phi3ForCausalLM", rope_types=("longrope",), rope_aliases=(("su", "longrope"), ("yarn", "longrope")),
             implemented_fields=frozenset({"partial_rotary_factor"}),
             defaults=(("max_position_embeddings", 4096), ("rms_norm_eps", 1e-5))),
]
