"""Tiny random checkpoints of any transformers architecture, written by transformers itself (its own
save_pretrained, so the hub's tensor names and layout), with the demo's real BPE tokenizer and chat template."""
from __future__ import annotations

import json
from pathlib import Path

TINY_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, max_position_embeddings=512, initializer_range=0.1,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_tiny_hf(path: str | Path, config_class: str, *, seed: int = 0, generation_config: dict | None = None,
                  **overrides) -> Path:
    """A checkpoint directory for `transformers.<config_class>(**TINY_COMMON, **overrides)`, random weights
    drawn under `seed`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from engine.demo import CHAT_TEMPLATE, build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    ids = dict(bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("<|im_end|>"),
               pad_token_id=tok.token_to_id("<pad>"))
    cfg = getattr(transformers, config_class)(**{**TINY_COMMON, "vocab_size": tok.get_vocab_size(), **ids,
                                                 **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path))
    gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"], "do_sample": False,
           **(generation_config or {})}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
