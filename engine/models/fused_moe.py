"""The sparse-MoE experts as one grouped GEMM per projection (Triton): the (token, expert) pairs are sorted
by expert on the device, each expert's group padded to a tile, and one kernel launch computes every active
expert's tiles, as vLLM's fused_moe does. No host sync, so it runs inside CUDA graphs. Same signature as
engine/models/moe.py's `grouped_experts` (ExpertsFn); without CUDA the kernel runs through Triton's
interpreter (TRITON_INTERPRET=1), which is how the CPU tests check it.

Per step: align (pairs sorted and padded by expert) -> gate_up GEMM over the pairs ([T*k, 2I]) -> SiLU * up
-> down GEMM scaled by the routing weights ([T*k, H]) -> sum over each token's k pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    from affinity_serve.engine.models import _triton_moe
    return _triton_moe


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted pair ids [T*k + E*(block_m - 1)] grouped by expert, each group padded to a
    multiple of block_m with T*k; the expert of each block of block_m entries, -1 past the last group).
    Sizes depend on T, k and E only (not on the routing), so a CUDA graph can capture it."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # scatter_add, not bincount: bincount sizes its output from the max id, a host sync on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)                                           # [E]
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)                                       # pair ids by expert
    sorted_experts = flat[order]
    start = torch.cumsum(counts, 0) - counts                                       # unpadded group starts
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    capacity = num_pairs + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_pairs: int,
          a_row_div: int, weights: torch.Tensor | None, block_m: int) -> torch.Tensor:
    """C [num_pairs, n]: row p = A[p // a_row_div] @ W[expert of p]^T (times weights[p])."""
    _, n, k = w.shape
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = (64, 32) if n >= 64 else (32, 32)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (block_expert.numel(), -(-n // block_n))
    _kernels().grouped_gemm[grid](
        a, w, c, sorted_ids, block_expert, weights if weights is not None else c, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        PREC=prec, UPCAST=_interpreting() and a.dtype != torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return c


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_ids / topk_weights [T, k] -> [T, H]."""
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    num_pairs = t * k
    inter = down_proj.shape[-1]
    sorted_ids, block_expert = align_by_expert(topk_ids, gate_up_proj.shape[0], block_m)
    h = _gemm(x, gate_up_proj, sorted_ids, block_expert, num_pairs, k, None, block_m)        # [T*k, 2I]
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)                   # [T*k, I]
    y = _gemm(act, down_proj, sorted_ids, block_expert, num_pairs, 1,
              topk_weights.reshape(-1).float().contiguous(), block_m)                       # [T*k, H]
    return y.view(t, k, -1).float().sum(dim=1).to(x.dtype)


def self_test(device: str) -> str | None:
    """None when the kernel compiles on `device` and agrees with the grouped torch path (float32, small
    shapes); else why not, in a line."""
    from affinity_serve.engine.models.moe import grouped_experts, route
    try:
        dev = torch.device(device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).to(dev)
        w13 = (torch.randn(4, 48, 32, generator=g) * 0.1).to(dev)
        w2 = (torch.randn(4, 32, 24, generator=g) * 0.1).to(dev)
        weights, ids = route(torch.randn(5, 4, generator=g).to(dev), 2, True)
        err = float((fused_experts(x, w13, w2, ids, weights) - grouped_experts(x, w13, w2, ids, weights)).abs().max())
        return None if err <= 1e-4 else f"it differs from the grouped path by {err:.1e}"
    except Exception as e:                       # a missing compiler, an unsupported GPU, a Triton too old, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
