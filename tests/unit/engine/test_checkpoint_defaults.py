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
