"""Pure-torch paged attention (CPU and reference): correct for decode, chunked prefill and mixed batches."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, write_kv


class TorchPagedAttention:
    """Decodes are batched into one SDPA over gathered pages; prefill chunks run one SDPA each.

    A prefill chunk with no cached context attends over its own fresh K/V (plain causal); a chunk
    after cached context gathers its pages and uses a bottom-right-aligned causal mask.
    """

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
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
                ki, vi = _gather(kv_cache, meta.block_tables[i:i + 1], sl)   # [1, KVH, sl, D]
                mask = torch.ones(ql, sl, dtype=torch.bool, device=q.device).tril(sl - ql)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, nd: int,
                scale: float) -> torch.Tensor:
        max_len = max(meta.seq_lens_list[:nd])
        k, v = _gather(kv_cache, meta.block_tables[:nd], max_len)             # [nd, KVH, L, D]
        qd = q.unsqueeze(2)                                                    # [nd, H, 1, D]
        if min(meta.seq_lens_list[:nd]) == max_len:
            o = F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)
        else:
            lens = meta.seq_lens[:nd].to(torch.int64)
            mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]   # [nd, L]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                               enable_gqa=True)
        return o.squeeze(2)


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_tables`' requests, [B, KVH, length, D], read through their pages."""
    bs = kv_cache.shape[2]
    nblk = -(-length // bs)
    idx = block_tables[:, :nblk].to(torch.int64)
    b = idx.shape[0]
    k = kv_cache[0][idx].reshape(b, nblk * bs, *kv_cache.shape[3:])[:, :length]
    v = kv_cache[1][idx].reshape(b, nblk * bs, *kv_cache.shape[3:])[:, :length]
    return k.transpose(1, 2), v.transpose(1, 2)
