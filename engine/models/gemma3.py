"""Gemma 2 and Gemma 3 decoders (text): the shared attention (engine/models/llama.py) with Gemma's pieces around it.

embed * sqrt(hidden) -> N x (norm -> attention -> norm -> residual -> norm -> GELU-tanh MLP -> norm ->
residual) -> norm -> lm_head (-> soft-cap when the config has one). Every norm is Gemma's RMSNorm, scaling by
(1 + weight) in float32 before rounding. Sliding-window layers rotate with the local RoPE table, global
layers with the global one. The per-token fused ops (Triton / C) implement Llama's norm, so this model runs
the torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from affinity_serve.engine.attention.base import AttentionBackend, AttentionMetadata, per_layer
from affinity_serve.engine.models import fused
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.llama import Attention, LlamaForCausalLM
from affinity_serve.engine.models.rope import cos_sin_table


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.is_sliding = layer_idx in args.sliding_layers
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(args, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(args)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's, as LlamaForCausalLM's; weights tied unless the config says not."""

    def __init__(self, args: ModelArgs, max_positions: int):
        nn.Module.__init__(self)
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        for name, rope in (("rope", args.rope), ("local", args.local_rope or args.rope)):
            cos, sin = cos_sin_table(rope, args.head_dim, max_positions)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)
        self.lm_head_t: torch.Tensor | None = None
        self.fused = False
        self.ops = fused

    def use_fused_ops(self, on: bool = True, ops=fused) -> None:
        """The fused ops implement Llama's RMSNorm, not Gemma's: this model keeps the torch ops."""

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        super().init_rope(max_positions, device)
        cos, sin = cos_sin_table(self.args.local_rope or self.args.rope, self.args.head_dim, max_positions)
        self.local_cos, self.local_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids: [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.args.hidden_size ** 0.5, dtype=x.dtype)
        pos = meta.positions
        tables = {False: (self.rope_cos[pos].to(x.dtype), self.rope_sin[pos].to(x.dtype)),
                  True: (self.local_cos[pos].to(x.dtype), self.local_sin[pos].to(x.dtype))}
        for layer, kv_cache, m in zip(self.layers, kv_caches, per_layer(meta, len(self.layers))):
            x = layer(x, *tables[layer.is_sliding], kv_cache, m, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
