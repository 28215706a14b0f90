"""Write small randomly initialised Llama-family checkpoints in standard Hugging Face format.

config.json + model.safetensors + a byte-level BPE tokenizer trained here on a built-in text + a chat
template, so the demo server and every test run with no downloads, through the same loading path a
user's checkpoint takes. Same arguments -> byte-identical weights.
"""
from __future__ import annotations

import json
from pathlib import Path

_TEXT = """\
Affinity serve is a small language model server. It keeps the key and value cache of every prompt
in paged blocks, and it sends each request to the replica that most likely holds its prefix.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be, or not to be, that is the question. All that glitters is not gold. Knowledge is power.
Once upon a time there was a cluster of machines that served many users at once, fairly and fast.
The scheduler hands out a token budget every step; the runner computes, the sampler chooses.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # $ % & * + =
Unicode: café naïve résumé façade Ångström über straße 東京 日本語 中文 한국어 Привет мир Γειά σου ✓ → ★ 🙂 🚀
def hello(name): return f"hello {name}"  # code is text too
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Tell me a story. Assistant: Once upon a time, a small model learned to speak.
"""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def build_tokenizer(vocab_size: int = 1024):
    """A real byte-level BPE tokenizer trained on the built-in text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    return tok


def write_demo_model(path: str | Path, *, arch: str = "llama", hidden_size: int = 256, num_layers: int = 4,
                     num_heads: int = 8, num_kv_heads: int = 4, intermediate_size: int = 688,
                     vocab_size: int | None = None, max_position_embeddings: int = 2048,
                     tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                     rope_scaling: dict | None = None, init_std: float = 0.1, seed: int = 0,
                     shards: int = 1, dtype: str = "float32") -> Path:
    """Write a checkpoint directory and return its path.

    vocab_size defaults to the tokenizer's size; a larger value pads the embedding (ids the tokenizer
    cannot decode are then possible). init_std is larger than usual so random logits have clear winners.
    dtype ("float32", "bfloat16", "float16") is the stored weights' type (config.json's torch_dtype).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    vocab = vocab_size or tok.get_vocab_size()
    head_dim = hidden_size // num_heads
    cfg = {
        "architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<pad>"), "initializer_range": init_std,
        "attention_bias": False, "mlp_bias": False,
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
        cfg.pop("attention_bias")
    if arch == "mistral":
        cfg["sliding_window"] = None
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * init_std).to(getattr(torch, dtype))

    kv = num_kv_heads * head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rnd(num_heads * head_dim, hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = rnd(kv, hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = rnd(kv, hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = rnd(hidden_size, num_heads * head_dim)
        if arch == "qwen2":
            tensors[p + "self_attn.q_proj.bias"] = rnd(num_heads * head_dim)
            tensors[p + "self_attn.k_proj.bias"] = rnd(kv)
            tensors[p + "self_attn.v_proj.bias"] = rnd(kv)
        tensors[p + "mlp.gate_proj.weight"] = rnd(intermediate_size, hidden_size)
        tensors[p + "mlp.up_proj.weight"] = rnd(intermediate_size, hidden_size)
        tensors[p + "mlp.down_proj.weight"] = rnd(hidden_size, intermediate_size)
        tensors[p + "input_layernorm.weight"] = 1.0 + rnd(hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rnd(hidden_size)
    tensors["model.norm.weight"] = 1.0 + rnd(hidden_size)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = rnd(vocab, hidden_size)
    _save(tensors, path, shards, save_file)
    return path


def _save(tensors: dict, path: Path, shards: int, save_file) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(path / fname), metadata=meta)
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def default_demo_model_dir() -> Path:
    import os
    root = Path(os.environ.get("AFFINITY_SERVE_CACHE", Path.home() / ".cache" / "affinity-serve"))
    return root / "demo-llama"


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """The demo checkpoint, generated once and reused (regenerated if incomplete)."""
    path = Path(path) if path else default_demo_model_dir()
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        write_demo_model(path)
    return path
