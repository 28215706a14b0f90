"""Attention backends: `torch` (CPU / reference), `triton` and `flash` (GPU), chosen by `select_backend`."""
from __future__ import annotations

import logging

from affinity_serve.engine.attention.base import AttentionBackend, AttentionMetadata, build_attention_metadata
from affinity_serve.engine.attention.torch_paged import CASCADE_MIN_TOKENS

logger = logging.getLogger(__name__)


def select_backend(name: str, device: str, block_size: int, *, cpu_kernels: bool = True,
                   cascade_min_tokens: int | None = CASCADE_MIN_TOKENS, sliding_window: bool = False,
                   softcap: bool = False) -> AttentionBackend:
    """'auto' -> flash when CUDA, flash-attn and the block size allow it, else triton on CUDA when its kernels
    pass a start-up self-test there, else torch; 'torch' / 'flash' / 'triton' force one. cascade_min_tokens:
    decode batches sharing at least this many leading tokens read them once (torch and triton; None: never).
    sliding_window / softcap: the model has sliding-window layers / soft-capped attention scores; every
    backend implements both (the triton kernels since issue 31), so they no longer change the choice."""
    from affinity_serve.engine.attention.flash import FlashPagedAttention, flash_attn_available
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention, interpreting

    if name == "auto":
        name = _auto(device, block_size)
    if name == "flash":
        if device != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend 'flash' needs a CUDA device and the flash-attn package "
                             "(pip install 'affinity-serve[gpu]'); use 'torch' or 'auto' instead")
        return FlashPagedAttention(block_size)
    if name == "triton":
        if device != "cuda" and not interpreting():
            raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run its "
                             "kernels slowly on CPU for testing); use 'torch' or 'auto' instead")
        return TritonPagedAttention(cascade_min_tokens=cascade_min_tokens)
    if name == "torch":
        return TorchPagedAttention(cpu_kernels=cpu_kernels and device == "cpu", cascade_min_tokens=cascade_min_tokens)
    raise ValueError(f"unknown attention_backend {name!r}; use 'auto', 'torch', 'triton' or 'flash'")


def _auto(device: str, block_size: int) -> str:
    """What 'auto' means here. Triton needs a working toolchain at run time (it compiles a small C launcher
    and the kernels for this GPU), so it is taken only once its kernels have compiled and agreed with the
    torch backend on a small mixed batch on this device; otherwise a warning says why, and torch runs."""
    from affinity_serve.engine.attention import flash, triton_paged

    if device != "cuda":
        return "torch"
    if flash.flash_attn_available() and block_size % 256 == 0:
        return "flash"
    if triton_paged.triton_available():
        why = triton_paged.self_test(device, block_size)
        if why is None:
            return "triton"
        logger.warning("attention_backend auto: the triton kernels failed their self-test on this device (%s); "
                       "using the torch backend", why)
    return "torch"


__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "select_backend"]
