"""Sparse mixture-of-experts: a softmax router picks each token's top-k SwiGLU experts.

The expert computation is one function with one signature (`ExpertsFn`), so a device kernel can replace
the CPU path without the model changing. The CPU path groups the (token, expert) pairs by expert and runs
one gate_up GEMM and one down GEMM per expert that has tokens this step, never a loop over tokens.
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
    """The CPU path: sort the T*k (token, expert) pairs by expert, one GEMM pair per active expert, then
    scatter-add each pair's weighted output back to its token (expert order within a token, as transformers
    adds them)."""
    t, k = topk_ids.shape
    inter = down_proj.shape[-1]
    flat = topk_ids.reshape(-1)                                           # [T*k]
    order = torch.argsort(flat, stable=True)                              # pairs grouped by expert
    token_of = order // k                                                 # [T*k] each sorted pair's token
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    xs = x[token_of]                                                      # [T*k, H]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], gate_up_proj[e])                # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        ys[start:start + n] = F.linear(h, down_proj[e])                   # [n, H]
        start += n
    ys = (ys.float() * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


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
