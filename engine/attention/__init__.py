"""Attention backends: `torch` (CPU / reference), `triton` and `flash` (GPU), chosen by `select_backend`."""
from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata, build_attention_metadata


def select_backend(name: str, device: str, block_size: int, *, cpu_kernels: bool = True) -> AttentionBackend:
    """'auto' -> flash when CUDA, flash-attn and the block size allow it, else triton on CUDA when it imports,
    else torch; 'torch' / 'flash' / 'triton' force one."""
    from engine.attention.flash import FlashPagedAttention, flash_attn_available
    from engine.attention.torch_paged import TorchPagedAttention
    from engine.attention.triton_paged import TritonPagedAttention, interpreting, triton_available

    if name == "auto":
        if device == "cuda" and flash_attn_available() and block_size % 256 == 0:
            name = "flash"
        elif device == "cuda" and triton_available():
            name = "triton"
        else:
            name = "torch"
    if name == "flash":
        if device != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend 'flash' needs a CUDA device and the flash-attn package "
                             "(pip install 'affinity-serve[gpu]'); use 'torch' or 'auto' instead")
        return FlashPagedAttention(block_size)
    if name == "triton":
        if device != "cuda" and not interpreting():
            raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run its "
                             "kernels slowly on CPU for testing); use 'torch' or 'auto' instead")
        return TritonPagedAttention()
    if name == "torch":
        return TorchPagedAttention(cpu_kernels=cpu_kernels and device == "cpu")
    raise ValueError(f"unknown attention_backend {name!r}; use 'auto', 'torch', 'triton' or 'flash'")


__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "select_backend"]
