"""Sparse mixture-of-experts: a softmax router picks each token's top-k SwiGLU experts.

The expert computation is one function with one signature (`ExpertsFn`), so a device kernel can replace
the CPU path without the model changing. On CPU in float32 the engine runs `CpuExperts`, a C kernel
(engine/csrc/moe_experts.c) that takes each layer's (token, expert) pairs grouped by expert through the
gate_up GEMM, SiLU * up, the down GEMM and the weighted sum in one call. The torch path (`grouped_experts`,
other dtypes or without a C compiler) runs every expert's gate_up and down GEMMs as two batched GEMMs over
the groups padded to the largest (or, with few tokens, a GEMM pair per expert that has tokens this step).
Neither loops over tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from affinity_serve.engine.models.config import MoESpec

#: (x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_ids [T, k], topk_weights [T, k] float32)
#: -> [T, H] in x's dtype
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k]): softmax in float32, top-k, and
    the top-k weights divided by their sum when `renormalize` (as the checkpoint's config says)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The CPU path: the T*k (token, expert) pairs grouped by expert, each expert's rows through its gate_up and
    down GEMMs, each pair's output weighted and added to its token in expert order (transformers' order, so the
    float sums match). When most experts have tokens (a batch's decode, any prefill) the groups are padded to
    the largest and every expert runs in one batched GEMM pair (`_padded_experts`): one call reads all the
    weights, where a GEMM per expert on its few rows runs far below the machine's bandwidth. Otherwise (a few
    tokens) a GEMM pair per active expert (`_looped_experts`)."""
    t, k = topk_ids.shape
    num_experts = gate_up_proj.shape[0]
    ids, slot = torch.sort(topk_ids, dim=1)                               # each token's experts, ascending
    weights = torch.gather(topk_weights, 1, slot).reshape(-1, 1)          # [T*k, 1] float32
    flat = ids.reshape(-1)                                                # [T*k] pairs, token-major
    counts = torch.bincount(flat, minlength=num_experts)
    num_active = int((counts > 0).sum())
    max_rows = int(counts.max())
    if 2 * num_active >= num_experts and num_experts * max_rows <= 4 * t * k:
        ys = _padded_experts(x, gate_up_proj, down_proj, flat, counts, max_rows, k)
    else:
        ys = _looped_experts(x, gate_up_proj, down_proj, flat, counts.tolist(), k)
    ys = (ys.float() * weights).to(x.dtype).view(t, k, -1)                # [T, k, H], expert order per token
    out = ys[:, 0].clone()
    for j in range(1, k):
        out += ys[:, j]
    return out


def _rank_in_expert(flat: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, rank): the pairs sorted by expert (stable), and each pair's row within its expert's group."""
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return order, rank


def _padded_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, flat: torch.Tensor,
                    counts: torch.Tensor, max_rows: int, k: int) -> torch.Tensor:
    """Every expert's rows padded to `max_rows` (zeros), two batched GEMMs over all experts; [T*k, H] in pair
    order."""
    num_experts, two_inter, hidden = gate_up_proj.shape
    _, rank = _rank_in_expert(flat, counts)
    dest = flat * max_rows + rank                                         # [T*k] each pair's padded row
    xs = x.new_zeros(num_experts * max_rows, hidden)
    xs[dest] = x.repeat_interleave(k, dim=0)
    h = torch.bmm(xs.view(num_experts, max_rows, hidden), gate_up_proj.transpose(1, 2))   # [E, R, 2I]
    inter = two_inter // 2
    a = F.silu(h[..., :inter]).mul_(h[..., inter:])                       # [E, R, I]
    y = torch.bmm(a, down_proj.transpose(1, 2))                           # [E, R, H]
    return y.view(num_experts * max_rows, hidden)[dest]


def _looped_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, flat: torch.Tensor,
                    counts: list[int], k: int) -> torch.Tensor:
    """A GEMM pair per expert with rows; [T*k, H] in pair order."""
    inter = down_proj.shape[-1]
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]                                                    # [T*k, H] grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], gate_up_proj[e])                # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        ys[start:start + n] = F.linear(h, down_proj[e])                   # [n, H]
        start += n
    out = torch.empty_like(ys)
    out[order] = ys
    return out


def _pairs_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """(sorted, offsets, pair_weights): the pairs p = t * k + j (token t's experts ascending in j) listed grouped
    by expert, where each expert's group starts ([E + 1]), and each pair's router weight (float32)."""
    ids, slot = torch.sort(topk_ids, dim=1)
    pair_weights = torch.gather(topk_weights.float(), 1, slot).contiguous()
    flat = ids.reshape(-1)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    return torch.argsort(flat, stable=True), offsets, pair_weights


class CpuExperts:
    """An `ExpertsFn` over the C kernel `moe_experts_f32` (engine/csrc/moe_experts.c; built and loaded with
    the other CPU kernels, engine/attention/cpu_kernels.py). float32 CPU tensors, the model's layouts."""

    def __init__(self, lib):
        import ctypes
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.moe_experts_f32
        self._fn.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, p, p, p, ctypes.c_int]
        self._fn.restype = None

    def __call__(self, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        num_experts, two_inter, hidden = gate_up_proj.shape
        for name, v in (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if v.dtype != torch.float32 or v.device.type != "cpu":
                raise ValueError(f"CpuExperts takes float32 CPU tensors; {name} is {v.dtype} on {v.device}")
        if (x.shape != (t, hidden) or down_proj.shape != (num_experts, hidden, two_inter // 2)
                or topk_weights.shape != (t, k)):
            raise ValueError(f"CpuExperts: x {tuple(x.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, down_proj "
                             f"{tuple(down_proj.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} do not fit [T, H], [E, 2I, H], [E, H, I], [T, k], [T, k]")
        out = torch.empty(t, hidden)
        if t == 0:
            return out
        if x.stride(-1) != 1:
            x = x.contiguous()
        gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
        order, offsets, pair_weights = _pairs_by_expert(topk_ids, topk_weights, num_experts)
        h = torch.empty(t * k, two_inter)
        y = torch.empty(t * k, hidden)
        self._fn(x.data_ptr(), x.stride(0), gate_up_proj.data_ptr(), down_proj.data_ptr(), order.data_ptr(),
                 offsets.data_ptr(), pair_weights.data_ptr(), t, k, num_experts, hidden, two_inter // 2,
                 h.data_ptr(), y.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out


class Experts(nn.Module):
    """The experts' weights stacked (transformers 5's layout): gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (Qwen2-MoE's shared_expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.inter = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Router (`gate`, no bias) + experts, plus a gated shared expert where the config has one; replaces the
    MLP in the layers MoESpec.layers names."""

    def __init__(self, hidden_size: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, hidden_size, spec.intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, spec.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.experts_fn: ExpertsFn = grouped_experts
        self.fused = False                       # the MLP's switches (use_fused_ops); unused here
        self.ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        weights, ids = route(self.gate(x), self.spec.top_k, self.spec.renormalize)
        out = self.experts_fn(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
