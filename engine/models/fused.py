"""Fused per-token ops for the GPU path: residual add + RMSNorm, RoPE over q and k, SiLU * up.

At batch 1 a 1B model's decode step is a few GEMMs per layer plus dozens of tiny elementwise kernels (the
float32 upcast, square, mean, rsqrt, ... of each RMSNorm; seven ops per rotated tensor). Measured on an H200
(eager profile, torch ops): those tiny kernels took about as long as the GEMMs. Each op below is one Triton
kernel. They are used with `attention_backend: triton` (the engine calls `LlamaForCausalLM.use_fused_ops`);
the torch ops stay the reference path (CPU, and the torch and flash backends).

Arithmetic follows transformers: float32 inside each op, rounded to the model's type where transformers
rounds (the residual sum, the normalised row before the weight, the SiLU before the multiply). RoPE is
computed in float32 and rounded once, which is closer to float32 than transformers' per-op rounding in
bf16. Without CUDA the same kernels run through Triton's interpreter (TRITON_INTERPRET=1), which is how
the CPU tests check them.
"""
from __future__ import annotations

import torch


def _k():
    from engine.models import _triton_ops
    return _triton_ops


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] (contiguous rows), updated in place to x + delta when delta is given; returns
    RMSNorm(x) * weight as a new tensor."""
    t, n = x.shape
    y = torch.empty_like(x)
    if t == 0:
        return y
    d = delta if delta is not None else x
    _k().add_rms_norm[(t,)](x, d, weight, y, x.stride(0), d.stride(0), y.stride(0), n, eps,
                            HAS_DELTA=delta is not None, BLOCK=_pow2(n))
    return y


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x in place. x: [T, heads, head_dim] with unit stride in the last dim (q and k together may be
    one view of the qkv projection); positions: [T]; cos / sin: the model's float32 [max_pos, rotary_dim]
    tables (each row two equal halves)."""
    t, heads, _ = x.shape
    if t == 0:
        return x
    assert x.stride(-1) == 1 and cos.stride(-1) == 1
    half = cos.shape[-1] // 2
    _k().rope[(t, heads)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=half,
                          BLOCK_H=_pow2(half))
    return x


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * n] = [gate | up] -> silu(gate) * up, [T, n]."""
    t, two_n = x.shape
    n = two_n // 2
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block = min(1024, _pow2(n))
    _k().silu_mul[(t, -(-n // block))](x, y, x.stride(0), y.stride(0), n, BLOCK=block)
    return y
