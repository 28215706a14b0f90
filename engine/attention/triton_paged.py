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

from affinity_serve.engine.attention.base import AttentionMetadata
from affinity_serve.engine.attention.torch_paged import CASCADE_MIN_TOKENS, _write_kv


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
    small mixed batch: decodes of different lengths (two of them sharing their first pages), a chunk after
    cached context, a fresh prefill; run with cascade decode and without, and with a sliding window and
    soft-capped scores. Else why not, in a line. Cached per (device, block size)."""
    from affinity_serve.engine.attention.base import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    try:
        dev = torch.device(device)
        g = torch.Generator().manual_seed(0)
        heads, kv_heads, dim = 4, 2, 32
        computed, sched = [37 + block_size, 40 + block_size, 20, 0], [1, 1, 9, 13]
        shared = max(1, 32 // block_size)         # pages decode 1 shares with decode 0 (about 32 tokens)
        tables, nxt = [], 1
        for i, (c, n) in enumerate(zip(computed, sched)):
            need = -(-(c + n) // block_size) - (shared if i == 1 else 0)
            tables.append((tables[0][:shared] if i == 1 else []) + list(range(nxt, nxt + need)))
            nxt += need
        full = [(torch.randn(c + n, kv_heads, dim, generator=g), torch.randn(c + n, kv_heads, dim, generator=g))
                for c, n in zip(computed, sched)]
        for x, y in zip(full[1], full[0]):
            x[:shared * block_size] = y[:shared * block_size]
        shape = TorchPagedAttention.kv_cache_shape(nxt, block_size, kv_heads, dim)
        caches = [torch.zeros(shape, device=dev) for _ in range(3)]
        ctx = [i for i, c in enumerate(computed) if c]
        pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx],
                                       block_size, dev)
        for cache in caches:
            _write_kv(torch.cat([full[i][0][:computed[i]] for i in ctx]).to(dev),
                      torch.cat([full[i][1][:computed[i]] for i in ctx]).to(dev), cache, pre.slot_mapping)
        q = torch.randn(sum(sched), heads, dim, generator=g).to(dev)
        k = torch.cat([kv[0][c:] for kv, c in zip(full, computed)]).to(dev)
        v = torch.cat([kv[1][c:] for kv, c in zip(full, computed)]).to(dev)
        backends = (TorchPagedAttention(cpu_kernels=False, cascade_min_tokens=None),
                    TritonPagedAttention(cascade_min_tokens=None), TritonPagedAttention(cascade_min_tokens=1))
        outs = [b.forward(q, k, v, cache, build_attention_metadata(computed, sched, tables, block_size, dev), 0.2)
                for b, cache in zip(backends, caches)]
        err = max(float((outs[0] - out).abs().max()) for out in outs[1:])
        # a 24-token sliding window and soft-capped scores (Gemma 2/3's attention) on the same batch
        windowed = [b.forward(q, k, v, cache, build_attention_metadata(computed, sched, tables, block_size, dev,
                                                                       sliding_window=24), 0.2, 5.0)
                    for b, cache in zip(backends[:2], caches)]
        err = max(err, float((windowed[0] - windowed[1]).abs().max()))
        return None if err <= 1e-3 else f"they differ from the torch backend by {err:.1e}"
    except Exception as e:                       # a missing compiler, an unsupported GPU, a Triton too old, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _kernels():
    """The kernels module (decode, prefill, write_kv, decode_split, decode_merge), compiled on first launch."""
    from affinity_serve.engine.attention import _triton_kernels
    return _triton_kernels


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8                                    # the interpreter: small, so the CPU tests take the split path


def decode_splits(device: torch.device, num_decodes: int, num_kv_heads: int, max_splits: int = 16) -> int:
    """Key-range splits per (request, KV head) for a decode batch: enough programs to give each SM about
    two, at most max_splits. A function of the batch shape only (not of the lengths), so a CUDA graph
    captured for a batch size and the eager step of that size split alike."""
    return max(1, min(max_splits, -(-2 * _num_sms(device) // (num_decodes * num_kv_heads))))


def prefix_splits(device: torch.device, rows: int, num_kv_heads: int, max_splits: int = 16) -> tuple[int, int]:
    """(key-range splits, query rows per program) of cascade decode's shared-prefix kernel over `rows` =
    requests x query heads per KV head: programs of up to 64 rows, split along the keys until each SM has
    about two. Like `decode_splits`, a function of the batch shape only."""
    block_r = min(64, _pow2(rows))
    tiles = -(-rows // block_r)
    return max(1, min(max_splits, -(-2 * _num_sms(device) // (tiles * num_kv_heads)))), block_r


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


class TritonPagedAttention:
    """Decode and prefill kernels over the paged cache (see the module docstring)."""

    name = "triton"
    supports_sliding_window = True
    supports_softcap = True
    #: reads `AttentionMetadata.cascade_prefix_len` on the device (the CUDA-graph path captures cascade graphs)
    device_cascade_len = True

    def __init__(self, block_n: int = 64, block_m: int = 64, max_splits: int = 16,
                 cascade_min_tokens: int | None = CASCADE_MIN_TOKENS):
        if not triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package (it comes with CUDA builds of "
                             "torch); use 'torch' or 'auto' instead")
        self.block_n, self.block_m, self.max_splits = block_n, block_m, max_splits
        #: decode batches whose requests share at least this many leading tokens (whole blocks, the same
        #: pages) read them once for the whole batch (cascade decode); None: never. Read on every step, so
        #: it can be switched on a live engine (the CUDA-graph path keeps a cascade graph per size for it).
        self.cascade_min_tokens = cascade_min_tokens
        self.num_cascade_forwards = 0              # eager forwards that took the cascade path (not graph replays)

    def cascade_len(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The device-side shared-prefix length this step's decodes attend in cascade, or None: the one the
        caller set (`meta.cascade_prefix_len`, a CUDA graph's buffer), else the metadata's common prefix
        when it is long enough (made once per step)."""
        if meta.cascade_prefix_len is not None:
            return meta.cascade_prefix_len
        n = meta.num_common_prefix_blocks * meta.block_size
        if self.cascade_min_tokens is None or meta.num_decodes < 2 or n < max(self.cascade_min_tokens, 1):
            return None
        memo = meta.backend_cache
        if "cascade_len" not in memo:
            memo["cascade_len"] = torch.full((1,), n, dtype=torch.int32, device=meta.seq_lens.device)
        return memo["cascade_len"]

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)       # the torch backend's layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        """`meta.sliding_window`: each query reads only its window's keys (tables hold the null block where it
        has passed); `softcap`: scores become softcap * tanh(score / softcap). Neither takes cascade decode."""
        kern = _kernels()
        _, kvh, nb, bs, hd = kv_cache.shape
        assert kv_cache.stride(2) == bs * hd and kv_cache.stride(3) == hd and kv_cache.stride(4) == 1, \
            "pages of contiguous [block_size, head_dim]"
        if meta.num_tokens:
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            kern.write_kv[(meta.num_tokens, kvh)](k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, k.stride(0),
                                                  k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(1), D=hd,
                                                  BLOCK_D=_pow2(hd))
        if q.stride(-1) != 1:
            q = q.contiguous()
        heads = q.shape[1]
        g = heads // kvh
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kc, vc = kv_cache[0], kv_cache[1]
        bt = meta.block_tables
        # fp32 stays fp32 in the dots (the torch backend's numbers); half types run on tensor cores anyway
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        window = meta.sliding_window
        common = dict(s_kh=kc.stride(0), s_kb=kc.stride(1), s_kt=kc.stride(2), s_bt=bt.stride(0), scale=scale,
                      window=window or 0, cap=softcap or 1.0, G=g, D=hd, BLOCK_D=_pow2(hd), BS=bs,
                      BLOCK_N=self.block_n, PREC=prec, WINDOWED=window is not None, SOFTCAP=softcap is not None)
        nd = meta.num_decodes
        splits = decode_splits(q.device, nd, kvh, self.max_splits) if nd else 1
        plain = window is None and softcap is None       # cascade decode reads the shared prefix unwindowed, uncapped
        prefix = self.cascade_len(meta) if nd and plain else None
        if nd and splits == 1 and prefix is None:
            kern.decode[(nd, kvh)](q, kc, vc, out, bt, meta.seq_lens, q.stride(0), q.stride(1), out.stride(0),
                                   out.stride(1), BLOCK_G=_pow2(g), **common)
        elif nd:
            # partial softmax states per (request, query head): `splits` slots for the keys each request reads
            # on its own, then, in cascade, `psplits` for the shared prefix; one merge over them all
            psplits, block_r = prefix_splits(q.device, nd * g, kvh, self.max_splits) if prefix is not None else (0, 0)
            slots = splits + psplits
            block_d = common["BLOCK_D"]
            m = torch.empty(nd * heads * slots, dtype=torch.float32, device=q.device)
            den = torch.empty_like(m)
            part = torch.empty(nd * heads * slots, block_d, dtype=torch.float32, device=q.device)
            kern.decode_split[(nd, kvh, splits)](q, kc, vc, m, den, part, bt, meta.seq_lens,
                                                 meta.seq_lens if prefix is None else prefix, q.stride(0),
                                                 q.stride(1), H=heads, S=splits, SROW=slots, BLOCK_G=_pow2(g),
                                                 SKIP_PREFIX=prefix is not None, **common)
            if prefix is not None:
                self.num_cascade_forwards += 1
                kern.decode_prefix[(kvh, -(-nd * g // block_r), psplits)](
                    q, kc, vc, m, den, part, bt, prefix, nd * g, q.stride(0), q.stride(1), kc.stride(0),
                    kc.stride(1), kc.stride(2), scale, H=heads, S=splits, P=psplits, SROW=slots, G=g, D=hd,
                    BLOCK_D=block_d, BS=bs, BLOCK_N=self.block_n, BLOCK_R=block_r, PREC=prec)
            kern.decode_merge[(nd, heads)](m, den, part, out, out.stride(0), out.stride(1), H=heads, S=slots,
                                           BLOCK_S=_pow2(slots), D=hd, BLOCK_D=block_d)
        num_prefills = len(meta.query_lens_list) - nd
        if num_prefills:
            longest = max(meta.query_lens_list[nd:])
            block_m = min(self.block_m, _pow2(longest))
            grid = (num_prefills, -(-longest // block_m), heads)
            kern.prefill[grid](q, kc, vc, out, bt, meta.seq_lens, meta.query_start_loc, nd, q.stride(0), q.stride(1),
                               out.stride(0), out.stride(1), BLOCK_M=block_m, **common)
        return out
