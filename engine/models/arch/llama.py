"""Llama, Mistral (every layer in its sliding window, kept by the KV manager) and Qwen2 (q/k/v biases): the plain
decoder."""
from affinity_serve.engine.models.registry import ArchSpec

SPECS = [
    ArchSpec("LlamaForCausalLM"),
    ArchSpec("MistralForCausalLM", defaults=(("max_position_embeddings", 131072), ("sliding_window", 4096))),
    ArchSpec("Qwen2ForCausalLM", qkv_bias=True, qkv_bias_always=True, sliding_window_default=False,
             defaults=(("max_position_embeddings", 32768),)),
]
