"""Mixtral: the Mistral decoder with a sparse-MoE block in every layer (top-k always renormalised);
checkpoints name it block_sparse_moe with experts' w1 (gate), w3 (up), w2 (down)."""
from typing import Any

from affinity_serve.engine.models.config import MoESpec
from affinity_serve.engine.models.registry import ArchSpec


def _moe(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"moe": MoESpec(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                           True, tuple(range(cfg["num_hidden_layers"])))}


SPECS = [
    ArchSpec("MixtralForCausalLM", moe=True, parse=_moe,
             defaults=(("max_position_embeddings", 131072), ("rms_norm_eps", 1e-5), ("rope_theta", 1000000.0)),
             renames=((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                      (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))),
]
