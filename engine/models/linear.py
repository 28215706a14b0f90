"""CPU weight prepacking: swap `nn.Linear` modules for oneDNN linears over pre-reordered weights.

On CPU, `F.linear` runs MKL's NT GEMM on the weight as stored. Decode steps multiply a few rows by
large weight matrices, and those skinny GEMMs run far below the machine's compute roof. oneDNN can
reorder a weight once into its blocked layout (what torch.compile's CPU freezing pass and IPEX do), so
every later call skips the per-call packing. Measured on a 2-core AVX2 box at 32 rows: 1.3-2x faster
on the layer GEMMs and ~2.5x on a 32000 x 512 lm_head; equal at prefill sizes.

The reordered weight replaces the original (no extra memory), except for a tied lm_head, which gets its
own packed copy beside the embedding table. Results agree with `F.linear` to float32 rounding.

One case goes the other way: a batch-1 decode step multiplies a single row, and MKL over a plain weight
beats oneDNN's packed kernel there. Measured on a 2-core AVX2 box, a 56M-parameter Llama's layer GEMMs at
one row: packed 5.5 ms, F.linear (x W^T) 4.0 ms, x @ W^T with W^T stored contiguous ([in, out]) 3.4 ms;
at two rows 5.9, 4.4 and 5.1 ms; from 4 rows on packed wins. `plain_rows` keeps that [in, out] copy too and
sends inputs of that many rows or fewer to it, which doubles the Linear weights' memory.

oneDNN builds (and caches: its own cache and PyTorch's ideep cache, 1,024 entries each) one primitive per
distinct row count, and a primitive for more rows holds more memory: with every step's token count a new
shape, a replica's heap grew by ~40 MB per 1,000 requests of mixed traffic for as long as a soak ran
(benchmarks/soak.py). So rows are padded up to a bucket (`row_bucket`: exact up to 8, then multiples of 8
up to 64, then of 64): at most ~45 shapes per weight whatever the traffic, at most 63 zero rows of extra
work on a GEMM of over 64 rows.
"""
from __future__ import annotations

import torch
from torch import nn


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN can run packed linears for this device and dtype in this torch build."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(getattr(ops, "_is_mkldnn_bf16_supported", lambda: False)())
    return False


#: at most this many rows go to F.linear over the plain weight when a PackedLinear keeps one (see above)
HYBRID_PLAIN_ROWS = 2


def row_bucket(n: int) -> int:
    """The row count a packed GEMM of `n` rows runs at (see the module doc): n up to 8, then the next
    multiple of 8 up to 64, then the next multiple of 64."""
    if n <= 8:
        return n
    if n <= 64:
        return -(-n // 8) * 8
    return -(-n // 64) * 64


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (and, with `plain_rows`, as stored too, for
    inputs of at most that many rows). Accepts any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plain_rows: int = 0):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters/buffers: an opaque mkldnn tensor must not go through
        # state_dict or .to(); the module is built after loading and never moved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach().clone()
        self.plain_rows = plain_rows
        self.plain_t = weight.detach().t().contiguous() if plain_rows > 0 else None      # [in, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.plain_rows:
            y = torch.mm(x2, self.plain_t) if self.bias is None else torch.addmm(self.bias, x2, self.plain_t)
            return y.view(*lead, self.out_features)
        n = x2.shape[0]
        rows = row_bucket(n)
        if rows != n:                     # a bounded set of shapes for oneDNN's primitive caches
            padded = x2.new_zeros(rows, self.in_features)
            padded[:n] = x2
            y = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:n]
            return y.reshape(*lead, self.out_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"plain_rows={self.plain_rows}")


def prepack_linears(model: nn.Module, plain_rows: int = 0) -> int:
    """Replace every `nn.Linear` under `model` by a PackedLinear in place; returns how many were packed.
    `plain_rows` > 0 keeps a plain copy of each weight for inputs of at most that many rows (see the module doc).

    Call once, after the weights are loaded and tied, and only when `prepack_supported` is True.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias, plain_rows))
                count += 1
    return count

