"""KV-cache groups (vLLM v1's hybrid KV cache): which layers share a block table, and which KV tensor each
layer reads. Torch-free: the KV manager (scheduler side) and the model runner both use it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table: full attention (`window` None) or a sliding window of `window`
    tokens (a query at position p reads keys p - window + 1 .. p)."""

    layers: tuple[int, ...]
    window: int | None = None


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """Group layers as vLLM v1's hybrid allocator does: the layers of one attention type (full, or one window
    size) split into groups of G layers, G the smallest type's layer count; full-attention groups first.

    Group k's j-th layer and every other group's j-th layer share KV tensor j (`kv_tensor_of_layer`), so a
    block id names G layers' pages and is held by one group at a time: a sliding group's dropped blocks are
    real memory for any group. A model without sliding layers is one group of every layer (as before).
    """
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    size = min(len(v) for v in by_window.values())
    groups = []
    for w in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[w]
        groups.extend(KVCacheGroupSpec(tuple(layers[s:s + size]), w) for s in range(0, len(layers), size))
    return groups


def kv_tensor_of_layer(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[tuple[int, int]]:
    """layer -> (its group, the KV tensor it reads: its index within the group)."""
    out = [(0, 0)] * num_layers
    for g, spec in enumerate(groups):
        for j, layer in enumerate(spec.layers):
            out[layer] = (g, j)
    return out


def num_kv_tensors(groups: Sequence[KVCacheGroupSpec]) -> int:
    """KV tensors (of num_blocks pages each) the groups share: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def window_start_block(first_position: int, window: int, block_size: int) -> int:
    """The first block a query at `first_position` (or later) reads under `window`: earlier ones are dropped."""
    return max(0, first_position - window + 1) // block_size


def blocks_needed(groups: Sequence[KVCacheGroupSpec], num_tokens: int, block_size: int,
                  max_chunk_tokens: int | None = None) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once over `groups`: a full group one per
    block of tokens, a sliding group its window plus the largest chunk a step computes (`max_chunk_tokens`;
    None: the whole request), plus one block of alignment."""
    n = -(-num_tokens // block_size)
    chunk = min(max_chunk_tokens or num_tokens, num_tokens)
    return sum(n if g.window is None else min(n, -(-(g.window - 1 + chunk) // block_size) + 1) for g in groups)


def tokens_capacity(groups: Sequence[KVCacheGroupSpec], num_usable_blocks: int, block_size: int,
                    max_chunk_tokens: int | None = None) -> int:
    """The longest request `num_usable_blocks` blocks can hold (blocks_needed grows with the length: bisect)."""
    lo, hi = 0, num_usable_blocks * block_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed(groups, mid, block_size, max_chunk_tokens) <= num_usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
