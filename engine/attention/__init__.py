"""Attention backends: `torch` (CPU / reference) and `flash` (GPU, flash-attn 2), chosen by `select_backend`."""
from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata, build_attention_metadata


def select_backend(name: str, device: str, block_size: int, *, cpu_kernels: bool = True) -> AttentionBackend:
    """'auto' -> flash when CUDA and flash-attn are usable, else torch; 'torch'/'flash' force one."""
    from engine.attention.flash import FlashPagedAttention, flash_attn_available
    from engine.attention.torch_paged import TorchPagedAttention

    if name == "auto":
        name = "flash" if device == "cuda" and flash_attn_available() and block_size % 256 == 0 else "torch"
    if name == "flash":
        if device != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend 'flash' needs a CUDA device and the flash-attn package "
                             "(pip install 'affinity-serve[gpu]'); use 'torch' or 'auto' instead")
        return FlashPagedAttention(block_size)
    if name == "torch":
        return TorchPagedAttention(cpu_kernels=cpu_kernels and device == "cpu")
    raise ValueError(f"unknown attention_backend {name!r}; use 'auto', 'torch' or 'flash'")


__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "select_backend"]
