"""Triton paged attention (GPU): decode and prefill-with-context read the KV pages in place.

The cache layout is the torch backend's, [2, num_kv_heads, num_blocks, block_size, head_dim], so the KV
write, the block manager and the KV connectors are the same for both; any block size works (a page is a
run of `block_size` token rows of one KV head). Two kernels, both with an online softmax over key tiles of
BLOCK_N tokens gathered through the block table:
- decode: one program per (request, KV head); the query heads that share the KV head are the rows of the
  score tile (grouped-query attention without expanding K/V);
- prefill: one program per (request, BLOCK_M query tokens, query head); bottom-right-aligned causal mask,
  so a chunk after cached context attends over the context and itself. The step's own K/V are written to
  their pages first, so every key is read from the cache.

Triton is imported lazily and the kernels are compiled on first use. With TRITON_INTERPRET=1 they run on
CPU tensors through Triton's interpreter (slow; how the CPU test suite checks them).
"""
from __future__ import annotations

import functools
import os

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_paged import _write_kv


def triton_available() -> bool:
    """The package imports (the kernels still need CUDA, or TRITON_INTERPRET=1 for CPU tensors)."""
    try:
        import triton  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def self_test(device: str, block_size: int) -> str | None:
    """None when the kernels compile on `device` and agree with the torch backend (float32, within 1e-3) on a
    small mixed batch: decodes of different lengths, a chunk after cached context, a fresh prefill. Else why
    not, in a line. Cached per (device, block size)."""
    from engine.attention.base import build_attention_metadata
    from engine.attention.torch_paged import TorchPagedAttention
    try:
        dev = torch.device(device)
        g = torch.Generator().manual_seed(0)
        heads, kv_heads, dim = 4, 2, 32
        computed, sched = [37, 3, 20, 0], [1, 1, 9, 13]
        tables, nxt = [], 1
        for c, n in zip(computed, sched):
            need = -(-(c + n) // block_size)
            tables.append(list(range(nxt, nxt + need)))
            nxt += need
        full = [(torch.randn(c + n, kv_heads, dim, generator=g), torch.randn(c + n, kv_heads, dim, generator=g))
                for c, n in zip(computed, sched)]
        shape = TorchPagedAttention.kv_cache_shape(nxt, block_size, kv_heads, dim)
        caches = [torch.zeros(shape, device=dev) for _ in range(2)]
        ctx = [i for i, c in enumerate(computed) if c]
        pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx],
                                       block_size, dev)
        for cache in caches:
            _write_kv(torch.cat([full[i][0][:computed[i]] for i in ctx]).to(dev),
                      torch.cat([full[i][1][:computed[i]] for i in ctx]).to(dev), cache, pre.slot_mapping)
        q = torch.randn(sum(sched), heads, dim, generator=g).to(dev)
        k = torch.cat([kv[0][c:] for kv, c in zip(full, computed)]).to(dev)
        v = torch.cat([kv[1][c:] for kv, c in zip(full, computed)]).to(dev)
        outs = [b.forward(q, k, v, cache, build_attention_metadata(computed, sched, tables, block_size, dev), 0.2)
                for b, cache in zip((TorchPagedAttention(cpu_kernels=False), TritonPagedAttention()), caches)]
        err = float((outs[0] - outs[1]).abs().max())
        return None if err <= 1e-3 else f"they differ from the torch backend by {err:.1e}"
    except Exception as e:                       # a missing compiler, an unsupported GPU, a Triton too old, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _kernels():
    """(decode, prefill), compiled on first launch."""
    from engine.attention._triton_kernels import decode, prefill
    return decode, prefill


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


class TritonPagedAttention:
    """Decode and prefill kernels over the paged cache (see the module docstring)."""

    name = "triton"

    def __init__(self, block_n: int = 64, block_m: int = 64):
        if not triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package (it comes with CUDA builds of "
                             "torch); use 'torch' or 'auto' instead")
        self.block_n, self.block_m = block_n, block_m

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)       # the torch backend's layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _write_kv(k, v, kv_cache, meta.slot_mapping)
        decode, prefill = _kernels()
        if q.stride(-1) != 1:
            q = q.contiguous()
        _, kvh, _, bs, hd = kv_cache.shape
        heads = q.shape[1]
        g = heads // kvh
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kc, vc = kv_cache[0], kv_cache[1]
        bt = meta.block_tables
        # fp32 stays fp32 in the dots (the torch backend's numbers); half types run on tensor cores anyway
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        common = dict(s_kh=kc.stride(0), s_kb=kc.stride(1), s_kt=kc.stride(2), s_bt=bt.stride(0), scale=scale,
                      G=g, D=hd, BLOCK_D=_pow2(hd), BS=bs, BLOCK_N=self.block_n, PREC=prec)
        nd = meta.num_decodes
        if nd:
            decode[(nd, kvh)](q, kc, vc, out, bt, meta.seq_lens, q.stride(0), q.stride(1), out.stride(0),
                              out.stride(1), BLOCK_G=_pow2(g), **common)
        num_prefills = len(meta.query_lens_list) - nd
        if num_prefills:
            longest = max(meta.query_lens_list[nd:])
            block_m = min(self.block_m, _pow2(longest))
            grid = (num_prefills, -(-longest // block_m), heads)
            prefill[grid](q, kc, vc, out, bt, meta.seq_lens, meta.query_start_loc, nd, q.stride(0), q.stride(1),
                          out.stride(0), out.stride(1), BLOCK_M=block_m, **common)
        return out
