"""The decoder every registered architecture uses (engine/models/registry.py), over flat token batches and
a paged KV cache.

Reads top to bottom like the paper: embed -> N x (RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU
or sparse MoE -> residual) -> RMSNorm -> lm_head. q/k/v and gate/up projections are fused into one GEMM
each; Qwen3's per-head q/k RMSNorm runs before RoPE.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from affinity_serve.engine.attention.base import AttentionBackend, AttentionMetadata, per_layer
from affinity_serve.engine.models import fused
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.linear import prepack_linears
from affinity_serve.engine.models.moe import SparseMoE
from affinity_serve.engine.models.rope import apply_rope, cos_sin_table

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:       # one fused pass; same arithmetic as below, bit-identical here
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim ** -0.5
        self.softcap = args.attn_logit_softcapping
        self.ops = fused                             # the fused-op implementation (use_fused_ops)
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """cos / sin: gathered per token ([T, rotary_dim], model dtype), or with `positions` (fused ops) the
        float32 tables themselves."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:                  # per-head RMSNorm of q and k, before RoPE, in place
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if positions is not None:                    # fused ops: q and k rotated by one kernel, in place
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            self.ops.rope_(qk, positions, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)                               # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                            # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if positions is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                # in place
        if self.softcap is None:
            o = backend.forward(q, k, v, kv_cache, meta, self.scale)              # [T, H, D]
        else:
            o = backend.forward(q, k, v, kv_cache, meta, self.scale, self.softcap)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter = args.intermediate_size
        self.fused = False
        self.ops = fused
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        is_moe = args.moe is not None and layer_idx in args.moe.layers
        self.mlp = SparseMoE(args.hidden_size, args.moe) if is_moe else MLP(args)
        self.ops = fused

    def forward(self, x, cos, sin, kv_cache, meta, backend):
        """x is updated in place (the residual stream is owned by the forward pass)."""
        x.add_(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))

    def forward_fused(self, x, delta, positions, cos, sin, kv_cache, meta, backend):
        """Fused ops: x += delta (the previous layer's MLP output) inside the first norm; returns the updated
        residual stream and this layer's MLP output, which the next norm adds."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        h = self.ops.add_rms_norm(x, delta, n1.weight, n1.eps)
        a = self.self_attn(h, cos, sin, kv_cache, meta, backend, positions)
        return x, self.mlp(self.ops.add_rms_norm(x, a, n2.weight, n2.eps))


class LlamaForCausalLM(nn.Module):
    """Checkpoint parameter names follow Hugging Face's (`model.layers.N...`); see loader.py."""

    def __init__(self, args: ModelArgs, max_positions: int):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = cos_sin_table(args.rope, args.head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        self.lm_head_t: torch.Tensor | None = None
        #: per-token ops as fused kernels; set by use_fused_ops
        self.fused = False
        self.ops = fused

    def use_fused_ops(self, on: bool = True, ops=fused) -> None:
        """Run RMSNorm (with the residual add), RoPE and SiLU * up as fused kernels. `ops`: the Triton
        kernels of engine/models/fused.py (CUDA, or CPU tensors under TRITON_INTERPRET=1), or anything with
        the same three functions, such as the C kernels of engine/attention/cpu_kernels.CpuOps (CPU)."""
        self.fused = on
        self.ops = ops
        for layer in self.layers:
            layer.ops = layer.self_attn.ops = layer.mlp.ops = ops
            layer.mlp.fused = on
        self._use_fused_moe(on and ops is fused, getattr(ops, "experts", None) if on else None)

    def _use_fused_moe(self, on: bool, cpu_experts=None) -> None:
        """With the Triton ops, the MoE layers' experts run as the Triton grouped GEMM (engine/models/
        fused_moe.py: no host sync, so decode graphs capture it) once it passes a self-test; with the C ops,
        as their C kernel (`cpu_experts`, engine/models/moe.py CpuExperts); else grouped (torch)."""
        moe_layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        if not moe_layers:
            return
        from affinity_serve.engine.models import fused_moe
        from affinity_serve.engine.models.moe import grouped_experts
        why = fused_moe.self_test(str(self.embed_tokens.weight.device)) if on else "off"
        if on and why is not None:
            logger.warning("the Triton fused-MoE kernel failed its self-test (%s); experts run grouped", why)
        for mlp in moe_layers:
            mlp.experts_fn = (fused_moe.fused_experts if why is None else
                              cpu_experts if cpu_experts is not None else grouped_experts)

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        """(Re)compute the float32 cos / sin tables on `device` (after loading: they were built on meta)."""
        cos, sin = cos_sin_table(self.args.rope, self.args.head_dim, max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def prepare_for_inference(self, prepack: bool = False, plain_rows: int = 0) -> None:
        """Last step of loading. `prepack`: swap every Linear for a oneDNN prepacked one (see linear.py),
        which also keeps its plain weight for inputs of at most `plain_rows` rows.

        Otherwise, on CPU, keep a [hidden, vocab] copy of the lm_head weight: MKL's NN GEMM is markedly
        faster than the NT one (F.linear) for this tall matrix (~1.3-1.8x at 1-32 rows).
        """
        if prepack:
            prepack_linears(self, plain_rows)
        elif self.lm_head.weight.device.type == "cpu":
            self.lm_head_t = self.lm_head.weight.detach().t().contiguous()

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids: [T] -> final hidden states [T, hidden] (logits are computed separately)."""
        x = self.embed_tokens(input_ids)
        if self.fused:
            delta = None
            for layer, kv_cache, m in zip(self.layers, kv_caches, per_layer(meta, len(self.layers))):
                x, delta = layer.forward_fused(x, delta, meta.positions, self.rope_cos, self.rope_sin, kv_cache,
                                               m, backend)
            return self.ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)
        dtype = x.dtype
        cos = self.rope_cos[meta.positions].to(dtype)
        sin = self.rope_sin[meta.positions].to(dtype)
        for layer, kv_cache, m in zip(self.layers, kv_caches, per_layer(meta, len(self.layers))):
            x = layer(x, cos, sin, kv_cache, m, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only positions that sample) -> float32 logits [N, vocab]."""
        if self.lm_head_t is not None:
            return (hidden @ self.lm_head_t).float()
        return self.lm_head(hidden).float()
