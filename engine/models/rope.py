"""Rotary position embeddings: inverse frequencies per scaling type, and a cos/sin table by position."""
from __future__ import annotations

import math

import torch

from affinity_serve.engine.models.config import RopeSpec


def inv_freq_and_scale(rope: RopeSpec, head_dim: int, max_positions: int | None = None
                       ) -> tuple[torch.Tensor, float]:
    """[rotary_dim // 2] inverse frequencies and the attention scaling applied to cos/sin. `max_positions`:
    the context served (longrope picks its factors by it)."""
    dim = int(head_dim * rope.params.get("partial_rotary_factor", 1.0))
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = rope.params
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope.rope_type == "yarn":
        return _yarn(base, dim, p)
    if rope.rope_type == "longrope":
        return _longrope(base, dim, p, max_positions)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or p["max_position_embeddings"] / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, attn


def _longrope(base: float, dim: int, p: dict, max_positions: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE. transformers picks short_factor while the sequence fits
    original_max_position_embeddings and long_factor beyond; one table serves every sequence here, so the
    choice follows the context served: short when it fits the original length (then exact), else long at
    every position."""
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or p["max_position_embeddings"] / orig
    attn = p.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = max_positions is not None and max_positions > orig
    ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attn


def cos_sin_table(rope: RopeSpec, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, rotary_dim] in float32, exactly as transformers computes them."""
    inv_freq, scale = inv_freq_and_scale(rope, head_dim, max_positions)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x in place and return it. x: [T, heads, head_dim] (may be a strided view); cos/sin:
    [T, rotary_dim] already gathered by position, each the concatenation of two equal halves.

    Same arithmetic as transformers' `x * cos + rotate_half(x) * sin` on each half
    (x1 c - x2 s, x2 c + x1 s), without materialising rotate_half or the full-width products.
    """
    rot = cos.shape[-1]
    half = rot // 2
    c = cos[:, None, :half]
    s = sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:rot]
    new1 = x1 * c - x2 * s
    x2.mul_(c).add_(x1 * s)
    x1.copy_(new1)
    return x
