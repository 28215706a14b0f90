"""Pure-torch paged attention (CPU and reference): correct for decode, chunked prefill and mixed batches.

Cache layout per layer: [2, num_kv_heads, num_blocks, block_size, head_dim] (head-major), so gathering
a request's pages is one index_select that already has the [kv_heads, tokens, head_dim] shape SDPA
wants, with no transpose copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata


class TorchPagedAttention:
    """Decodes run as one SDPA over gathered pages; prefill chunks run one SDPA each.

    Decode uses the grouped-query trick: the query heads that share a KV head become that head's
    "query rows", so SDPA runs over [kv_heads, batch, group, head_dim] without expanding K/V.
    A prefill chunk with no cached context attends over its own fresh K/V (plain causal); a chunk
    after cached context gathers its pages and uses a bottom-right-aligned causal mask.
    """

    name = "torch"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _write_kv(k, v, kv_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_tokens:
            return self._decode(q, kv_cache, meta, nd, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, nd, scale)
        qls, sls = meta.query_lens_list, meta.seq_lens_list
        start = nd
        for i in range(nd, len(qls)):
            ql, sl = qls[i], sls[i]
            end = start + ql
            qi = q[start:end].transpose(0, 1).unsqueeze(0)                  # [1, H, ql, D]
            if ql == sl:
                ki = k[start:end].transpose(0, 1).unsqueeze(0)              # [1, KVH, ql, D]
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ki, vi = _gather(kv_cache, meta.block_tables[i:i + 1], sl)   # [KVH, 1, sl, D]
                mask = torch.ones(ql, sl, dtype=torch.bool, device=q.device).tril(sl - ql)
                o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1), vi.transpose(0, 1), attn_mask=mask,
                                                   scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int,
                scale: float) -> torch.Tensor:
        kvh, hd = kv_cache.shape[1], kv_cache.shape[-1]
        heads = q.shape[1]
        qg = q.view(nd, kvh, heads // kvh, hd).transpose(0, 1)                 # [KVH, nd, G, D]
        common = meta.num_common_prefix_blocks
        if common * meta.block_size >= CASCADE_MIN_TOKENS and _HAS_CPU_LSE_KERNEL and q.device.type == "cpu":
            o = _cascade_decode(qg, kv_cache, meta, nd, common, scale)
        else:
            lens = meta.seq_lens_list[:nd]
            max_len = max(lens)
            k, v = _gather(kv_cache, meta.block_tables[:nd], max_len)         # [KVH, nd, L, D]
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=_length_mask(meta.seq_lens[:nd], max_len, lens),
                                               scale=scale)
        return o.transpose(0, 1).reshape(nd, heads, hd)


#: shared-prefix length from which decode attention reads the prefix once for the whole batch
CASCADE_MIN_TOKENS = 64
_HAS_CPU_LSE_KERNEL = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _length_mask(seq_lens: torch.Tensor, max_len: int, lens: list[int]) -> torch.Tensor | None:
    """[nd, 1, L] True where a key position is inside its request (None when all lengths are equal)."""
    if min(lens) == max_len:
        return None
    return (torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None])[:, None, :]


def _cascade_decode(qg: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int, common: int,
                    scale: float) -> torch.Tensor:
    """Decode attention split at a prefix every request shares (cascade attention).

    The shared prefix's K/V are read once and attended by all nd x G query rows together; each
    request's own suffix is attended separately; the two softmax pieces are merged exactly with their
    log-sum-exps. Saves gathering (nd - 1) copies of the prefix every step.
    """
    kvh, _, g, hd = qg.shape
    bs = meta.block_size
    prefix_len = common * bs
    idx = meta.block_tables[0, :common].to(torch.int64)
    pk = kv_cache[0].index_select(1, idx).view(1, kvh, prefix_len, hd)
    pv = kv_cache[1].index_select(1, idx).view(1, kvh, prefix_len, hd)
    q_all = qg.reshape(1, kvh, nd * g, hd)
    o1, lse1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_all, pk, pv, scale=scale)
    o1, lse1 = o1.view(kvh, nd, g, hd), lse1.view(kvh, nd, g)
    lens = [n - prefix_len for n in meta.seq_lens_list[:nd]]
    max_len = max(lens)
    sk, sv = _gather(kv_cache, meta.block_tables[:nd, common:], max_len)     # [KVH, nd, Ls, D]
    mask = _length_mask(meta.seq_lens[:nd] - prefix_len, max_len, lens)
    float_mask = None
    if mask is not None:
        float_mask = torch.zeros(mask.shape, dtype=qg.dtype, device=qg.device).masked_fill_(~mask, float("-inf"))
        float_mask = float_mask.unsqueeze(0)                       # [1, nd, 1, Ls]: the kernel wants 4-D
    o2, lse2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, sk, sv, attn_mask=float_mask,
                                                                          scale=scale)
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into their slots."""
    _, kvh, nb, bs, d = kv_cache.shape
    kv_cache[0].view(kvh, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(kvh, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_tables`' requests read through their pages: [KVH, B, length, D] each."""
    _, kvh, _, bs, d = kv_cache.shape
    nblk = -(-length // bs)
    b = block_tables.shape[0]
    idx = block_tables[:, :nblk].reshape(-1).to(torch.int64)
    k = kv_cache[0].index_select(1, idx).view(kvh, b, nblk * bs, d)
    v = kv_cache[1].index_select(1, idx).view(kvh, b, nblk * bs, d)
    if nblk * bs != length:
        k, v = k[:, :, :length], v[:, :, :length]
    return k, v
