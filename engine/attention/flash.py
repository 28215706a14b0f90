"""flash-attn 2 paged backend (GPU). Imported lazily; the input preparation is shared with torch.

Upstream flash-attn 2's paged KV (block_table) requires block_size % 256 == 0 (flash_api.cpp); only
vLLM's fork accepts multiples of 16. We validate this up front instead of failing inside the kernel.
"""
from __future__ import annotations

import torch

from affinity_serve.engine.attention.base import AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError):       # a python-only install without its CUDA extension raises too
        return False
    return True


def validate_flash_block_size(block_size: int) -> None:
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(f"the flash attention backend needs cache.block_size to be a multiple of "
                         f"{FLASH_BLOCK_MULTIPLE} (upstream flash-attn 2 paged KV constraint), got {block_size}; "
                         f"set cache.block_size: 256 or use attention_backend: torch")


class FlashPagedAttention:
    name = "flash"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, block_size: int):
        validate_flash_block_size(block_size)
        from flash_attn import flash_attn_varlen_func    # lazy: optional dependency
        self._varlen = flash_attn_varlen_func

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)      # NHD pages, as flash-attn reads them

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        _, nb, bs, h, d = kv_cache.shape
        kv_cache[0].view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, v)
        # One varlen call for the whole mixed batch; causal is bottom-right aligned, which is what
        # chunked prefill over cached context needs. k/v are the paged caches, cu_seqlens_k the KV lengths.
        return self._varlen(q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_start_loc,
                            meta.max_query_len, meta.max_seq_len, **flash_kwargs(meta, scale, softcap))


def flash_kwargs(meta: AttentionMetadata, scale: float, softcap: float | None) -> dict:
    """flash_attn_varlen_func's keyword arguments for one layer's metadata. A sliding window is
    window_size=(window - 1, 0): flash-attn counts the keys left of the query, the window counts the query
    too; the kernel starts each row at its window's first page, so the null blocks before it are never read."""
    window = meta.sliding_window
    return dict(softmax_scale=scale, causal=True, block_table=meta.block_tables,
                window_size=(-1, -1) if window is None else (window - 1, 0), softcap=softcap or 0.0)
