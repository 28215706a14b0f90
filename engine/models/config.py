"""ModelArgs: the Llama-family architecture read from a checkpoint's config.json (no torch needed)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

#: architectures name in config.json -> whether q/k/v projections carry a bias by default
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)   # factor, low_freq_factor, ...


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
            raise ModelLoadError(f"config.json has no {e.args[0]!r}, which a Llama-family model needs") from e

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads ({heads}) must be a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = cfg.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=bool(qkv_bias),
            o_bias=bool(cfg.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_spec(cfg),
            sliding_window=sliding,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    """Both spellings: transformers 5 `rope_parameters`, and older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "yarn" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    if rope_type == "yarn":
        params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return RopeSpec(rope_type, float(theta), params)
