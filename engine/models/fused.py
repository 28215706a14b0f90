"""Fused per-token ops for the GPU path: residual add + RMSNorm, RoPE over q and k, SiLU * up.

At batch 1 a 1B model's decode step is a few GEMMs per layer plus dozens of tiny elementwise kernels (the
float32 upcast, square, mean, rsqrt, ... of each RMSNorm; seven ops per rotated tensor). Measured on an H200
(eager profile, torch ops): those tiny kernels took about as long as the GEMMs. Each op below is one Triton
kernel. They are used with `attention_backend: triton` (the engine calls `LlamaForCausalLM.use_fused_ops`);
the torch ops stay the reference path. On CPU in float32 the engine uses C twins of these three instead
(`engine.attention.cpu_kernels.CpuOps`, same signatures; `self_test` checks either).

Arithmetic follows transformers: float32 inside each op, rounded to the model's type where transformers
rounds (the residual sum, the normalised row before the weight, the SiLU before the multiply). RoPE is
computed in float32 and rounded once, which is closer to float32 than transformers' per-op rounding in
bf16. Without CUDA the same kernels run through Triton's interpreter (TRITON_INTERPRET=1), which is how
the CPU tests check them.
"""
from __future__ import annotations

import functools

import torch


def _k():
    from affinity_serve.engine.models import _triton_ops
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
    block = _pow2(n)
    # a row is one program: more warps for wide rows keep the per-thread share (registers) bounded
    _k().add_rms_norm[(t,)](x, d, weight, y, x.stride(0), d.stride(0), y.stride(0), n, eps,
                            HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
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


@functools.lru_cache(maxsize=8)
def self_test(device: str, ops=None) -> str | None:
    """None when the three kernels (this module's, or `ops` with the same functions) compile on `device`
    and agree with the torch ops (float32, small shapes); else why not, in a line. The engine switches the
    fused ops on only after this passes."""
    import sys

    import torch.nn.functional as F

    from affinity_serve.engine.models.rope import apply_rope
    ops = ops if ops is not None else sys.modules[__name__]
    try:
        dev = torch.device(device)
        g = torch.Generator().manual_seed(0)
        x, d = (torch.randn(3, 48, generator=g).to(dev) for _ in range(2))
        w = torch.rand(48, generator=g).to(dev) + 0.5
        ref_x = x + d
        ref = torch.rms_norm(ref_x, (48,), w, 1e-6)
        errs = [float((ops.add_rms_norm(x, d, w, 1e-6) - ref).abs().max()), float((x - ref_x).abs().max())]
        cos, sin = torch.rand(16, 8, generator=g).to(dev), torch.rand(16, 8, generator=g).to(dev)
        q = torch.randn(4, 3, 8, generator=g).to(dev)
        pos = torch.tensor([0, 5, 9, 15], device=dev)
        ref_q = apply_rope(q.clone(), cos[pos], sin[pos])
        errs.append(float((ops.rope_(q, pos, cos, sin) - ref_q).abs().max()))
        gu = torch.randn(2, 64, generator=g).to(dev)
        errs.append(float((ops.silu_mul(gu) - F.silu(gu[:, :32]) * gu[:, 32:]).abs().max()))
        err = max(errs)
        return None if err <= 1e-4 else f"they differ from the torch ops by {err:.1e}"
    except Exception as e:                       # a missing compiler, an unsupported GPU, a Triton too old, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
