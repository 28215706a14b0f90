"""The architecture registry: config.json `architectures` name -> ArchSpec, discovered from engine/models/arch/.

Adding an architecture built from the shared decoder blocks (engine/models/llama.py: attention with optional
per-head q/k RMSNorm, a SwiGLU MLP or a sparse-MoE block) is one file in engine/models/arch/ that defines
`SPECS` (plus a parity test). Torch-free, so the CLI's pre-flight check can name the supported ones.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one architecture's config.json and checkpoint map onto the shared decoder."""

    name: str                                   # the `architectures` entry, e.g. "Qwen3ForCausalLM"
    qkv_bias: bool = False                      # q/k/v biases when config.json has no attention_bias
    #: q/k/v biases regardless of attention_bias, and never an o_proj bias (Qwen2)
    qkv_bias_always: bool = False
    qk_norm: bool = False                       # per-head RMSNorm on q and k before RoPE (Qwen3)
    moe: bool = False                           # a sparse-MoE block replaces the MLP (see moe_layers)
    #: checkpoint name fragment -> ours, applied before the q/k/v and gate/up fusing (Mixtral's w1/w2/w3)
    renames: tuple[tuple[str, str], ...] = ()
    #: config.json fields this architecture implements beyond the common ones (never refused)
    implemented_fields: frozenset[str] = frozenset()
    #: RoPE types beyond the common ones (config.py's SUPPORTED_ROPE_TYPES), and names read as another type
    rope_types: tuple[str, ...] = ()
    rope_aliases: tuple[tuple[str, str], ...] = ()
    #: the context cap from `sliding_window` applies (else the field is ignored unless use_sliding_window)
    sliding_window_default: bool = True
    #: tie_word_embeddings when config.json omits it: the family's transformers config default (Gemma's True)
    tie_word_embeddings: bool = False
    #: config.json values when it omits the key: the family's transformers config defaults, where they differ
    #: from the common ones config.py assumes (max_position_embeddings 2048, rms_norm_eps 1e-6, rope_theta 1e4)
    defaults: tuple[tuple[str, Any], ...] = ()
    #: hidden_act values the model code implements
    activations: tuple[str, ...] = ("silu", "swish")
    #: "module:Class" of the model (imported on use: this module stays torch-free)
    model: str = "affinity_serve.engine.models.llama:LlamaForCausalLM"
    #: extra ModelArgs values read from config.json (MoE sizes, ...); may override the common ones
    parse: Callable[[dict[str, Any]], dict[str, Any]] | None = field(default=None, compare=False)


def model_class(spec: ArchSpec) -> type:
    """The nn.Module class that builds `spec`'s models."""
    module, _, name = spec.model.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.cache
def architectures() -> dict[str, ArchSpec]:
    """Every spec in engine/models/arch/*.py, by architecture name."""
    from affinity_serve.engine.models import arch
    found: dict[str, ArchSpec] = {}
    for info in pkgutil.iter_modules(arch.__path__):
        module = importlib.import_module(f"{arch.__name__}.{info.name}")
        for spec in getattr(module, "SPECS", ()):
            assert spec.name not in found, f"architecture {spec.name} registered twice"
            found[spec.name] = spec
    return found
