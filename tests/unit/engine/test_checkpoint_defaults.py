"""config.json fields a checkpoint may omit take the family's transformers default: Gemma's released configs
omit tie_word_embeddings (transformers' Gemma2Config / Gemma3TextConfig default it to True) and ship no
lm_head.weight."""
import json

import pytest
import torch

from affinity_serve.engine import validate_checkpoint
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.loader import load_model
from affinity_serve.engine.models.registry import architectures
from tests.unit.engine.tiny_hf import write_tiny_hf


def _model_type(arch: str) -> str:
    """transformers' model_type whose causal-LM class is `arch` (Gemma3ForCausalLM: gemma3_text)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    family = arch.removesuffix("ForCausalLM").lower()
    found = [mt for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
             if cls == arch and mt.removesuffix("_text").replace("_", "") == family]
    assert len(found) == 1, (arch, found)
    return found[0]


@pytest.mark.parametrize("arch", sorted(architectures()))
def test_tie_word_embeddings_default_is_the_familys_transformers_default(arch):
    from transformers import CONFIG_MAPPING
    cfg = CONFIG_MAPPING[_model_type(arch)]().to_dict()
    want = cfg.pop("tie_word_embeddings")
    cfg["architectures"] = [arch]
    assert ModelArgs.from_dict(cfg).tie_word_embeddings is want


@pytest.mark.parametrize("config_class", ["Gemma2Config", "Gemma3TextConfig"])
def test_a_gemma_config_without_tie_word_embeddings_loads_tied(tmp_path, config_class):
    from transformers import AutoConfig
    path = write_tiny_hf(tmp_path, config_class, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=16, tie_word_embeddings=True)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["tie_word_embeddings"]                   # as Google's released configs
    (path / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(str(path)).tie_word_embeddings is True     # transformers reads it tied
    assert validate_checkpoint(path).tie_word_embeddings is True
    model, args = load_model(path, torch.float32, torch.device("cpu"), 64)
    assert args.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)


#: keys whose omission the weights' shape check catches (sizes), or that the tokenizer and generation config
#: supply (token ids): no default is needed for them to fail loudly or work
_SIZES_AND_IDS = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                  "bos_token_id", "eos_token_id", "pad_token_id"}


def _normal(args: ModelArgs) -> ModelArgs:
    """A partial rotary factor of 1.0 rotates every dimension, as none does."""
    import dataclasses

    def rope(r):
        if r is None or r.params.get("partial_rotary_factor", 1.0) != 1.0:
            return r
        return dataclasses.replace(r, params={k: v for k, v in r.params.items() if k != "partial_rotary_factor"})
    return dataclasses.replace(args, rope=rope(args.rope), local_rope=rope(args.local_rope))


@pytest.mark.parametrize("base", ["default", "tiny"])
@pytest.mark.parametrize("arch", sorted(architectures()))
def test_every_omitted_key_takes_the_familys_transformers_default(arch, base):
    """A config.json with any one key left out reads as transformers reads it (its config class fills the
    default in): Mistral's and Gemma's sliding_window, Gemma 2's soft-caps, Gemma's query_pre_attn_scalar (256,
    not head_dim), Mixtral's and Gemma 3's RoPE base, Mixtral's and Phi-3's rms_norm_eps, every family's
    max_position_embeddings ... `base`: the family's default config, or a tiny one with head_dim 16."""
    from transformers import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[_model_type(arch)]
    over = {} if base == "default" else dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, intermediate_size=128, num_hidden_layers=2)
    full = config_class(**over).to_dict()
    full["architectures"] = [arch]
    differ = {}
    for key in sorted(set(full) - _SIZES_AND_IDS - {"architectures"}):
        cfg = {k: v for k, v in full.items() if k != key}
        got = _normal(ModelArgs.from_dict(cfg))
        want = _normal(ModelArgs.from_dict({**config_class(**cfg).to_dict(), "architectures": [arch]}))
        if got != want:
            differ[key] = {f: (getattr(want, f), getattr(got, f)) for f in want.__dataclass_fields__
                           if getattr(want, f) != getattr(got, f)}
    assert not differ
