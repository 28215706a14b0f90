"""ModelArgs: the decoder architecture read from a checkpoint's config.json (no torch needed).

Which `architectures` are supported, and what each adds to the plain decoder, is engine/models/registry.py.
A config field that changes the math and that the model code does not implement is refused with one line
naming it (never silently ignored): see `_refuse_unimplemented`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from affinity_serve.engine.errors import ModelLoadError

from affinity_serve.engine.models.registry import ArchSpec, architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)   # factor, low_freq_factor, ...


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A sparse-MoE block: softmax router over `num_experts`, top `top_k` per token, SwiGLU experts."""

    num_experts: int
    top_k: int
    intermediate_size: int                    # each expert's
    renormalize: bool                         # top-k weights divided by their sum (Mixtral always; Qwen3-MoE
                                              # per norm_topk_prob)
    layers: tuple[int, ...]                   # the layers whose MLP is this block (the others keep a dense MLP)
    shared_intermediate_size: int = 0         # a shared SwiGLU expert every token goes through, scaled by
                                              # sigmoid(shared_expert_gate(x)) (Qwen2-MoE); 0: none


@dataclass(frozen=True, slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeSpec
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    moe: MoESpec | None = None
    hidden_act: str = "silu"
    attn_scale: float | None = None                # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    local_rope: RopeSpec | None = None             # RoPE of the sliding-window layers, when it differs (Gemma 3)
    sliding_layers: tuple[int, ...] = ()           # layers that attend within sliding_window (others: full)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None    # Gemma 2: attention scores soft-capped before the softmax

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention); the KV-cache groups follow from it."""
        return tuple(self.sliding_window if i in self.sliding_layers else None for i in range(self.num_layers))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is not a directory; pass a local Hugging Face "
                                 "checkpoint directory (config.json + *.safetensors + tokenizer files)")
        if not cfg_file.is_file():
            found = sorted(p.name for p in path.iterdir())[:20]
            raise ModelLoadError(f"{str(path)!r} has no config.json (found: {found})")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{str(cfg_file)!r} is not valid JSON: {e}") from e
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelArgs":
        try:
            return cls._from_dict(cfg)
        except KeyError as e:
            raise ModelLoadError(f"config.json has no {e.args[0]!r}, which this architecture needs") from e

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any]) -> "ModelArgs":
        specs = architectures()
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in specs), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {sorted(specs)}")
        spec = specs[arch]
        cfg = {**dict(spec.defaults), **cfg}
        _refuse_unimplemented(cfg, spec)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads ({heads}) must be a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        sliding = cfg.get("sliding_window")
        if not spec.sliding_window_default and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", spec.qkv_bias))
        fields = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", spec.tie_word_embeddings)),
            qkv_bias=True if spec.qkv_bias_always else attention_bias,
            o_bias=False if spec.qkv_bias_always else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_spec(cfg, spec),
            sliding_window=sliding,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=spec.qk_norm,
            hidden_act=cfg.get("hidden_act", cfg.get("hidden_activation", "silu")),
        )
        if spec.parse is not None:
            fields.update(spec.parse(cfg))
        if fields["sliding_window"] is not None and "sliding_layers" not in fields:
            fields["sliding_layers"] = _sliding_layers(cfg, fields["num_layers"])
        return cls(**fields)


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers `sliding_window` applies to: config.json's layer_types when it has them; Qwen2's layers
    from max_window_layers on (use_sliding_window); else every layer (Mistral)."""
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        return tuple(range(cfg["max_window_layers"], num_layers))
    return tuple(range(num_layers))


#: fields that change the math and that no architecture here implements: field -> its harmless values
_NEVER_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "partial_rotary_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "shared_expert_intermediate_size": (None, 0),
    "scoring_func": (None, "softmax"),
    "layer_norm_type": (None, "rms_norm", "rmsnorm"),
    "norm_type": (None, "rms_norm", "rmsnorm"),
    "use_bidirectional_attention": (None, False),
}


def _refuse_unimplemented(cfg: dict[str, Any], spec: ArchSpec) -> None:
    """One ModelLoadError naming the first config field whose value our model code would silently ignore."""
    def refuse(name: str, value: Any, supported: Any) -> ModelLoadError:
        return ModelLoadError(f"config.json: {name} = {value!r} is not implemented for {spec.name} "
                              f"(supported: {supported}); refusing rather than computing something else")

    for name in ("quantization_config", "compression_config"):      # the weights are not plain floats
        if cfg.get(name) is not None:
            quant = cfg[name]
            method = quant.get("quant_method", quant.get("format")) if isinstance(quant, dict) else quant
            raise refuse(f"{name}.quant_method", method,
                         "none (unquantized float32, bfloat16 or float16 weights)")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in spec.activations:
        raise refuse("hidden_act", act, " or ".join(spec.activations))
    for name, harmless in _NEVER_IMPLEMENTED.items():
        if name in spec.implemented_fields:
            continue
        value = cfg.get(name)
        if value not in harmless:
            raise refuse(name, value, " or ".join(repr(h) for h in harmless))
    if "layer_norm_eps" in cfg and "rms_norm_eps" not in cfg:
        raise refuse("layer_norm_eps", cfg["layer_norm_eps"], "RMSNorm (rms_norm_eps)")
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if rope.get("mrope_section") is not None:
        raise refuse("rope_scaling.mrope_section", rope["mrope_section"], "none (1-D RoPE)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and "partial_rotary_factor" not in spec.implemented_fields:
        raise refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], 1.0)
    if not spec.moe:
        for name in ("num_local_experts", "num_experts"):
            if cfg.get(name):
                raise refuse(name, cfg[name], "none (dense MLP)")


def _rope_spec(cfg: dict[str, Any], spec: ArchSpec | None = None) -> RopeSpec:
    """Both spellings: transformers 5 `rope_parameters`, and older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if spec is not None:
        rope_type = dict(spec.rope_aliases).get(rope_type, rope_type)
    supported = SUPPORTED_ROPE_TYPES + (spec.rope_types if spec is not None else ())
    if rope_type not in supported:
        raise ModelLoadError(f"config.json: rope_scaling.rope_type = {rope_type!r} is not implemented "
                             f"(unsupported RoPE scaling type; supported: {supported})")
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if rope_type in ("yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))
        params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return RopeSpec(rope_type, float(theta), params)
