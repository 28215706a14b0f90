"""The C per-token ops of the CPU path (engine/csrc/cpu_ops.c through cpu_kernels.CpuOps): the same checks
as the Triton ops (tests/common/fused_checks.py) in float32, on the sizes that take each loop's OpenMP path
and on edge values; the engine turning them on, and off with cpu_kernels: false."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from affinity_serve.engine.attention import cpu_kernels
from tests.common.fused_checks import check_add_rms_norm, check_rope, check_silu_mul

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.load_ops()
    if ops is None:
        pytest.skip("no C compiler here: the C ops cannot be built (the torch ops are what runs)")
    return ops


@pytest.mark.parametrize("rows,hidden", [(1, 80), (5, 80), (200, 512)], ids=["decode-row", "rows", "parallel"])
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add+norm"])
def test_add_rms_norm_matches_the_torch_ops(ops, rows, hidden, with_delta):
    check_add_rms_norm(CPU, torch.float32, with_delta, rows=rows, hidden=hidden, ops=ops)


def test_add_rms_norm_reads_rows_with_a_stride(ops):
    g = torch.Generator().manual_seed(4)
    base, delta = torch.randn(3, 100, generator=g), torch.randn(3, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    x = base[:, 10:74]                                   # row stride 100, unit stride in the row
    want_x = x + delta
    y = ops.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x) and torch.equal(base[:, :10], base[:, :10].clone())
    torch.testing.assert_close(y, torch.rms_norm(want_x, (64,), w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,partial", [(6, 1.0), (5, 0.5), (400, 1.0)],
                         ids=["rows", "partial-rotary", "parallel"])
def test_rope_rotates_q_and_k_in_one_view_of_the_projection(ops, tokens, partial):
    check_rope(CPU, torch.float32, tokens=tokens, heads=4, kv_heads=2, head_dim=32, ops=ops, partial_rotary=partial)


@pytest.mark.parametrize("rows,inter,scale", [(3, 40, 3.0), (1, 1408, 30.0), (64, 1100, 3.0)],
                         ids=["rows", "wide-range", "parallel"])
def test_silu_mul_matches_the_torch_ops(ops, rows, inter, scale):
    check_silu_mul(CPU, torch.float32, rows=rows, inter=inter, ops=ops, scale=scale)


def test_silu_mul_edge_values(ops):
    gate = torch.tensor([[0.0, -0.0, 1e-8, -1e-8, 20.0, -20.0, 86.9, -86.9, 88.0, -88.0, 200.0, -200.0, -1e30,
                          -3e38, 1e30, float("inf"), float("-inf"), float("nan")]])
    for up in (1.5, 1e5):
        x = torch.cat([gate, torch.full_like(gate, up)], dim=-1)
        # below -87 torch's logistic is a denormal and ours 0: equal to 1e-30 absolute, however large the gate
        torch.testing.assert_close(ops.silu_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-30, equal_nan=True)


def test_wrong_inputs_get_a_clear_error(ops):
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit stride"):
        ops.add_rms_norm(torch.zeros(8, 4).t(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"needs weight \(8,\)"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="delta of x's shape"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"needs \(3,\) positions"):
        ops.rope_(torch.zeros(3, 2, 8), torch.zeros(2, dtype=torch.int64), torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(ValueError, match="one shape and layout"):              # sin read with cos's row stride
        ops.rope_(torch.zeros(3, 2, 8), torch.zeros(3, dtype=torch.int64), torch.ones(4, 8), torch.ones(4, 16)[:, :8])
    x = torch.randn(3, 2, 8)
    before = x.clone()
    for bad in (4, -1):                                 # outside the 4-row tables: nothing read or written
        with pytest.raises(IndexError, match="outside the 4-row cos / sin tables"):
            ops.rope_(x, torch.tensor([0, bad, 1]), torch.ones(4, 8), torch.ones(4, 8))
        assert torch.equal(x, before)
    with pytest.raises(ValueError, match="must be even"):
        ops.silu_mul(torch.zeros(2, 7))


def test_the_engine_runs_them_on_cpu_float32_and_not_when_switched_off(checkpoints, ops):
    from affinity_serve.engine import LLM
    on = LLM(checkpoints["llama"], cache={"num_blocks": 16}).engine.runner.model
    assert on.fused and isinstance(on.ops, cpu_kernels.CpuOps)
    assert all(layer.mlp.ops is on.ops and layer.self_attn.ops is on.ops for layer in on.layers)
    off = LLM(checkpoints["llama"], cache={"num_blocks": 16}, cpu_kernels=False).engine.runner.model
    assert not off.fused
    bf16 = LLM(checkpoints["llama"], cache={"num_blocks": 16}, dtype="bfloat16").engine.runner.model
    assert not bf16.fused                                # float32 kernels only: bf16 keeps the torch ops
