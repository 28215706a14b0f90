"""Attention backend protocol and the input preparation every backend shares.

The batch is ordered decodes first (query length 1), then prefill chunks. `build_attention_metadata`
turns per-request (computed tokens, scheduled tokens, block table) into the flat tensors both the
torch and the flash-attn backends read, so this part is tested on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    num_decodes: int                    # the first num_decodes requests have query length 1
    slot_mapping: torch.Tensor          # [num_tokens] int64: block_id * block_size + offset
    positions: torch.Tensor             # [num_tokens] int64
    query_start_loc: torch.Tensor       # [num_reqs + 1] int32 (cu_seqlens_q)
    seq_start_loc: torch.Tensor         # [num_reqs + 1] int32 (cu_seqlens_k)
    seq_lens: torch.Tensor              # [num_reqs] int32: KV length after this step
    block_tables: torch.Tensor          # [num_reqs, max_blocks] int32, padded with the null block 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    #: leading block ids shared by every decode request (all full, each request has tokens after them)
    num_common_prefix_blocks: int = 0
    #: device int32 [1]: a shared-prefix length (tokens) that decode rows 0..num_decodes-1 may all read through
    #: block-table row 0, set by the CUDA-graph path (a graph replays whatever it holds; padding rows read the
    #: prefix too and are discarded). Backends that read it run cascade decode on it; None: they decide from
    #: num_common_prefix_blocks
    cascade_prefix_len: torch.Tensor | None = None
    #: per-step memo for a backend: what it derives from this metadata once and reuses in every layer
    backend_cache: dict = field(default_factory=dict)
    #: this KV-cache group's sliding window (a query at position p reads keys p - window + 1 .. p); None: full.
    #: The block tables hold the null block where the window has passed (those pages belong to others now)
    sliding_window: int | None = None
    #: models with several KV-cache groups: layer i's metadata (its group's tables and window); None: this one
    layer_metas: list["AttentionMetadata"] | None = None


def per_layer(meta: AttentionMetadata, num_layers: int) -> list[AttentionMetadata]:
    """Each layer's metadata: its KV-cache group's (see layer_metas), or `meta` for every layer."""
    return meta.layer_metas if meta.layer_metas is not None else [meta] * num_layers


def common_prefix_blocks(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """How many leading blocks the first len(seq_lens) rows of `tables` all hold, counting only whole blocks
    before each row's last token (`seq_lens`: each row's tokens after this step, so every row keeps at least
    one key of its own). Columns at or past a row's last token are not read: they may be padding or stale."""
    n = len(seq_lens)
    if n < 2:
        return 0
    width = int(seq_lens.min() - 1) // block_size
    if width <= 0 or (tables[1:n, 0] != tables[0, 0]).any():
        return 0
    same = (tables[:n, :width] == tables[0, :width]).all(0)
    return width if same.all() else int(same.argmin())


def build_attention_metadata(num_computed: list[int], num_scheduled: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device | str = "cpu",
                             sliding_window: int | None = None) -> AttentionMetadata:
    """Flat attention inputs for requests already ordered decodes-first.

    num_computed[i]: tokens of request i whose KV is already cached; num_scheduled[i]: tokens it
    computes this step; block_tables[i]: its block ids (long enough for computed + scheduled).
    sliding_window: the group's window (tables then hold null blocks where it has passed; no cascade).
    """
    n = len(num_scheduled)
    q_lens = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.asarray(num_computed, dtype=np.int64)
    total = int(q_lens.sum())
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    req_idx = np.repeat(np.arange(n), q_lens)
    positions = starts[req_idx] + (np.arange(total) - qsl[:-1][req_idx])
    max_blocks = max((len(b) for b in block_tables), default=1) or 1
    table = np.zeros((n, max_blocks), dtype=np.int64)
    for i, b in enumerate(block_tables):
        table[i, :len(b)] = b
    slots = table[req_idx, positions // block_size] * block_size + positions % block_size
    seq_lens = starts + q_lens
    ssl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=ssl[1:])
    num_decodes = 0
    while num_decodes < n and num_scheduled[num_decodes] == 1:
        num_decodes += 1
    common = common_prefix_blocks(table, seq_lens[:num_decodes], block_size) if sliding_window is None else 0
    dev = torch.device(device)
    return AttentionMetadata(
        num_tokens=total,
        num_decodes=num_decodes,
        slot_mapping=torch.from_numpy(slots).to(dev),
        positions=torch.from_numpy(positions).to(dev),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
        seq_start_loc=torch.from_numpy(ssl.astype(np.int32)).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
        block_tables=torch.from_numpy(table.astype(np.int32)).to(dev),
        query_lens_list=[int(x) for x in num_scheduled],
        seq_lens_list=seq_lens.tolist(),
        max_query_len=int(q_lens.max()) if n else 0,
        max_seq_len=int(seq_lens.max()) if n else 0,
        block_size=block_size,
        num_common_prefix_blocks=max(common, 0),
        sliding_window=sliding_window,
    )


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over each request's pages.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; kv_cache: one layer's cache in the
    backend's own layout (`kv_cache_shape`). Returns [T, num_heads, head_dim].
    All K/V of the step are written before any attention is computed.
    """

    name: str
    supports_sliding_window: bool
    supports_softcap: bool

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
        """softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2). A backend
        without soft-capping or sliding windows says so (`supports_softcap`, `supports_sliding_window`), and
        the engine never picks it for a model that needs them."""
