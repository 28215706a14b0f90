"""Tiny random checkpoints of any transformers architecture, written by transformers itself (its own
save_pretrained, so the hub's tensor names and layout), with the demo's real BPE tokenizer and chat template."""
from __future__ import annotations

import json
from pathlib import Path

_HALF_ROT = 4     # Phi-3 LongRoPE: head_dim 16, partial_rotary_factor 0.5 -> 8 rotary dims, 4 factors
#: name -> (transformers config class, its arguments beyond TINY_COMMON)
TINY_ARCHS = {
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", {}),
    "phi3_longrope": ("Phi3Config", dict(
        original_max_position_embeddings=128, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0 + 0.1 * i for i in range(_HALF_ROT)],
                         "long_factor": [2.0 + 0.5 * i for i in range(_HALF_ROT)]})),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=64, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
}

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

    from affinity_serve.engine.demo import CHAT_TEMPLATE, build_tokenizer

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


def load_reference_model(path: str | Path):
    """transformers' float32 model of a checkpoint, as the greedy references load it: eager attention where the
    config soft-caps attention scores (Gemma 2's attn_logit_softcapping). transformers 5.17 (the lent GPUs'
    Python) lets Gemma 2 default to SDPA, which drops that cap without a word (newer versions refuse SDPA for
    it), so its "reference" is the output of the model without the cap."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {}
    if getattr(AutoConfig.from_pretrained(str(path)), "attn_logit_softcapping", None) is not None:
        kw["attn_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


def tiny_checkpoints(root: str | Path) -> dict[str, str]:
    """name in TINY_ARCHS -> checkpoint directory under `root`, written on first use."""
    root = Path(root)

    class _Lazy(dict):
        def __missing__(self, name):
            cls, kw = TINY_ARCHS[name]
            self[name] = str(write_tiny_hf(root / name, cls, seed=sorted(TINY_ARCHS).index(name) + 11, **kw))
            return self[name]
    return _Lazy()
