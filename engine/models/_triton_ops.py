"""Triton kernels for the model's small per-token ops (see engine/models/fused.py). A module of its own,
imported on first use: Triton picks compiler or interpreter (TRITON_INTERPRET) when it decorates."""
import triton
import triton.language as tl


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, y_ptr, s_x, s_d, s_y, n, eps, HAS_DELTA: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One row: x += d (rounded to x's type, stored back) when HAS_DELTA; y = w * (x * rsqrt(mean(x^2) + eps))
    with the normalised row rounded to x's type before the weight multiply (transformers' order)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + row * s_x + i, mask=m, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * s_d + i, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * s_x + i, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * s_y + i, y, mask=m)


@triton.jit
def rope(x_ptr, pos_ptr, cos_ptr, sin_ptr, s_xt, s_xh, s_c, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """One (token, head) of the rotated heads, in place: x1 c - x2 s, x2 c + x1 s over the rotary halves,
    in float32 from the float32 cos / sin tables, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_H)
    m = i < HALF
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + p * s_c + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + p * s_c + i, mask=m, other=0.0)
    base = x_ptr + t * s_xt + h * s_xh
    x1 = tl.load(base + i, mask=m, other=0.0)
    x2 = tl.load(base + HALF + i, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + i, (a * c - b * s).to(x1.dtype), mask=m)
    tl.store(base + HALF + i, (b * c + a * s).to(x1.dtype), mask=m)


@triton.jit
def silu_mul(x_ptr, y_ptr, s_x, s_y, n, BLOCK: tl.constexpr):
    """y = silu(gate) * up for a row [gate | up] of 2n, silu rounded to the input type first (as
    F.silu(gate) * up computes it)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(x_ptr + row * s_x + i, mask=m, other=0.0)
    u = tl.load(x_ptr + row * s_x + n + i, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + row * s_y + i, (act.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=m)
