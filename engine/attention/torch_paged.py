"""Pure-torch paged attention (CPU and reference): correct for decode, chunked prefill and mixed batches.

Cache layout per layer: [2, num_kv_heads, num_blocks, block_size, head_dim] (head-major), so reading
a batch's pages is one index_select of whole pages that already has the [kv_heads, tokens, head_dim]
shape attention wants, with no transpose copy. Page indices are computed once per step and reused by
every layer (AttentionMetadata.backend_cache).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from affinity_serve.engine.attention.base import AttentionMetadata
from affinity_serve.engine.kv_groups import window_start_block

#: shared-prefix length from which decode attention reads the prefix once for the whole batch
CASCADE_MIN_TOKENS = 64


class TorchPagedAttention:
    """Decodes run as one batched attention over gathered pages; prefill chunks run one SDPA each.

    Decode uses the grouped-query trick: the query heads that share a KV head become that head's
    "query rows", so attention runs over [kv_heads, batch, group, head_dim] without expanding K/V.
    A prefill chunk with no cached context attends over its own fresh K/V (plain causal); a chunk
    after cached context gathers its pages and uses a bottom-right-aligned causal mask.
    """

    name = "torch"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, cpu_kernels: bool = True, cascade_min_tokens: int | None = CASCADE_MIN_TOKENS):
        """cpu_kernels: use the compiled C paged-decode kernel for float32 decode on CPU when it builds
        (engine/attention/cpu_kernels.py); otherwise decode runs on pure torch. cascade_min_tokens: decode
        batches sharing at least this many leading tokens (the same pages) read them once (`_cascade_decode`);
        None: never."""
        self.cascade_min_tokens = cascade_min_tokens
        self.num_cascade_forwards = 0              # forwards whose decode took the cascade path
        self.decode_kernel = None
        if cpu_kernels:
            from affinity_serve.engine.attention.cpu_kernels import load
            self.decode_kernel = load()

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        _write_kv(k, v, kv_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_tokens:
            return self._decode(q, kv_cache, meta, nd, scale, softcap)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, nd, scale, softcap)
        qls, sls = meta.query_lens_list, meta.seq_lens_list
        window, bs = meta.sliding_window, meta.block_size
        start = nd
        for i in range(nd, len(qls)):
            ql, sl = qls[i], sls[i]
            end = start + ql
            qi = q[start:end].transpose(0, 1).unsqueeze(0)                  # [1, H, ql, D]
            banded = window is not None and window < sl
            if ql == sl:                                                    # no cached context: its own K/V
                ki = k[start:end].transpose(0, 1).unsqueeze(0)              # [1, KVH, ql, D]
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                if not banded and softcap is None:
                    out[start:end] = F.scaled_dot_product_attention(
                        qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
                    start = end
                    continue
                first = 0
            else:                          # pages from the window's first block on (all of them without one)
                first = 0 if window is None else window_start_block(sl - ql, window, bs)
                idx = _page_index(kv_cache, meta.block_tables[i:i + 1, first:], sl - first * bs, bs)
                ki, vi = _gather(kv_cache, idx, 1, sl - first * bs)         # [KVH, 1, L, D]
                ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)
            mask = _causal_mask(ql, sl, first * bs, window, q.device)
            if softcap is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            else:
                o = _attend_expanded(qi, ki, vi, scale, mask, softcap)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int,
                scale: float, softcap: float | None = None) -> torch.Tensor:
        kvh, hd = kv_cache.shape[1], kv_cache.shape[-1]
        heads = q.shape[1]
        common = meta.num_common_prefix_blocks
        least = self.cascade_min_tokens
        cascade = least is not None and nd > 1 and common * meta.block_size >= max(least, 1) and softcap is None
        # a window no decode has outgrown yet reads what full attention reads
        windowed = meta.sliding_window is not None and max(meta.seq_lens_list[:nd]) > meta.sliding_window
        if (not windowed and softcap is None and not cascade and self.decode_kernel is not None
                and kv_cache.dtype == torch.float32 and kv_cache.device.type == "cpu"):
            return self.decode_kernel(q, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        qg = q.view(nd, kvh, heads // kvh, hd).transpose(0, 1)                 # [KVH, nd, G, D]
        if windowed:
            memo = meta.backend_cache
            if "window" not in memo:
                memo["window"] = _window_pages(kv_cache, meta, nd)
            idx, max_len, mask = memo["window"]
            k, v = _gather(kv_cache, idx, nd, max_len)                          # [KVH, nd, L, D]
            o = _attend(qg, k, v, scale, mask, softcap)
        elif cascade:
            self.num_cascade_forwards += 1
            o = _cascade_decode(qg, kv_cache, meta, nd, common, scale)
        else:
            memo = meta.backend_cache
            if "decode" not in memo:
                lens = meta.seq_lens_list[:nd]
                max_len = max(lens)
                memo["decode"] = (_page_index(kv_cache, meta.block_tables[:nd], max_len, meta.block_size), max_len,
                                  _length_mask(meta.seq_lens[:nd], max_len, lens))
            idx, max_len, mask = memo["decode"]
            k, v = _gather(kv_cache, idx, nd, max_len)                          # [KVH, nd, L, D]
            o = _attend(qg, k, v, scale, mask, softcap)
        return o.transpose(0, 1).reshape(nd, heads, hd)


def _causal_mask(ql: int, sl: int, key_offset: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[ql, sl - key_offset] True where a query (the last ql of sl positions) reads a key (positions from
    key_offset): causal, bottom-right aligned, and inside the sliding window when there is one."""
    q_pos = torch.arange(sl - ql, sl, device=device)[:, None]
    k_pos = torch.arange(key_offset, sl, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _window_pages(kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int):
    """Decode under a sliding window: (page index, padded length, mask) that read each request's pages from
    its window's first block only ([nd, 1, L] mask: inside the request and the window)."""
    bs, window = meta.block_size, meta.sliding_window
    lens = meta.seq_lens[:nd].to(torch.int64)
    first = (lens - window).clamp(min=0) // bs                                 # [nd] first block read
    nblk = int(((lens + bs - 1) // bs - first).max())
    cols = (first[:, None] + torch.arange(nblk, device=lens.device)[None, :]).clamp(
        max=meta.block_tables.shape[1] - 1)
    tables = meta.block_tables[:nd].to(torch.int64).gather(1, cols)             # [nd, nblk]
    pos = first[:, None] * bs + torch.arange(nblk * bs, device=lens.device)[None, :]
    mask = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
    return _page_index(kv_cache, tables, nblk * bs, bs), nblk * bs, mask[:, None, :]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over [..., rows, D] x [..., L, D], with `mask` True where keys count.

    Two batched GEMMs and a softmax: for decode's few query rows per (KV head, request) this is faster
    on CPU than SDPA's blocked flash kernel, whose tiles are sized for long queries.
    """
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32)
    return torch.matmul(p.to(v.dtype), v)


def _attend_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
                     softcap: float | None) -> torch.Tensor:
    """A prefill chunk's attention without SDPA (which has no soft-capping): q [1, H, ql, D], k / v
    [1, KVH, L, D], mask [ql, L] -> [1, H, ql, D]. The KV heads are shared by their query-head groups."""
    kvh, heads = k.shape[1], q.shape[1]
    qg = q.reshape(kvh, heads // kvh * q.shape[2], q.shape[3])                 # [KVH, G*ql, D]
    ql = q.shape[2]
    full = mask.repeat(heads // kvh, 1)                                         # [G*ql, L]
    o = _attend(qg, k[0], v[0], scale, full, softcap)                           # [KVH, G*ql, D]
    return o.view(1, heads, ql, q.shape[3])


def _length_mask(seq_lens: torch.Tensor, max_len: int, lens: list[int]) -> torch.Tensor | None:
    """[nd, 1, L] True where a key position is inside its request (None when all lengths are equal)."""
    if min(lens) == max_len:
        return None
    return (torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None])[:, None, :]


def _cascade_decode(qg: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int, common: int,
                    scale: float) -> torch.Tensor:
    """Decode attention split at a prefix every request shares (cascade attention).

    The shared prefix's K/V are read once and scored against all nd x G query rows in one GEMM; each
    request's own suffix is scored separately; one softmax over both parts (a common max, summed
    denominators) keeps the result exact. Saves gathering (nd - 1) copies of the prefix every step.
    """
    kvh, _, g, hd = qg.shape
    memo = meta.backend_cache
    if "cascade" not in memo:
        bs = meta.block_size
        plen = common * bs
        lens = [n - plen for n in meta.seq_lens_list[:nd]]
        max_len = max(lens)
        memo["cascade"] = (_page_index(kv_cache, meta.block_tables[:1, :common], plen, bs), plen,
                           _page_index(kv_cache, meta.block_tables[:nd, common:], max_len, bs), max_len,
                           _length_mask(meta.seq_lens[:nd] - plen, max_len, lens))
    pidx, plen, sidx, max_len, mask = memo["cascade"]
    pk, pv = _gather(kv_cache, pidx, 1, plen)                               # [KVH, 1, P, D]
    sk, sv = _gather(kv_cache, sidx, nd, max_len)                           # [KVH, nd, Ls, D]
    qs = qg * scale
    s1 = torch.matmul(qs.reshape(kvh, 1, nd * g, hd), pk.transpose(-1, -2)).float()   # [KVH, 1, nd*G, P]
    s2 = torch.matmul(qs, sk.transpose(-1, -2)).float()                                # [KVH, nd, G, Ls]
    if mask is not None:
        s2.masked_fill_(~mask, float("-inf"))
    m = torch.maximum(s1.amax(-1).view(kvh, nd, g), s2.amax(-1))[..., None]           # every row has a key
    e1 = (s1 - m.view(kvh, 1, nd * g, 1)).exp_()
    e2 = (s2 - m).exp_()
    denom = e1.sum(-1).view(kvh, nd, g, 1) + e2.sum(-1, keepdim=True)
    o = torch.matmul(e1.to(pv.dtype), pv).view(kvh, nd, g, hd) + torch.matmul(e2.to(sv.dtype), sv)
    return o / denom.to(o.dtype)


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into their slots."""
    _, kvh, nb, bs, d = kv_cache.shape
    kv_cache[0].view(kvh, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(kvh, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _page_index(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Row indices into the cache viewed as [2 * KVH * num_blocks, block_size * D] that read the first
    `length` tokens of each of `block_tables`' requests, K and V of every KV head in one gather."""
    _, kvh, nb = kv_cache.shape[:3]
    nblk = -(-length // block_size)
    base = torch.arange(2 * kvh, dtype=torch.int64, device=kv_cache.device) * nb
    return (base[:, None] + block_tables[:, :nblk].reshape(1, -1).to(torch.int64)).reshape(-1)


def _gather(kv_cache: torch.Tensor, index: torch.Tensor, num_reqs: int,
            length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V read through the pages `index` selects (see _page_index): [KVH, num_reqs, length, D] each.

    One index_select of whole pages (block_size x D contiguous elements each) for K and V together:
    ~1.5x faster than two selects along the block dimension.
    """
    _, kvh, nb, bs, d = kv_cache.shape
    nblk = index.numel() // (2 * kvh * num_reqs)
    kv = kv_cache.view(2 * kvh * nb, bs * d).index_select(0, index).view(2, kvh, num_reqs, nblk * bs, d)
    k, v = kv[0], kv[1]
    if nblk * bs != length:
        k, v = k[:, :, :length], v[:, :, :length]
    return k, v
