"""The Triton fused-MoE kernel (engine/models/fused_moe.py) on CPU through Triton's interpreter: the
alignment by expert, the experts against the grouped torch path in float32 and bfloat16, and a MoE model with
every fused op against the unfused one. tests/gpu/test_models_cuda.py runs the same kernel compiled."""
from __future__ import annotations

import pytest
import torch

from affinity_serve.engine.attention.triton_paged import interpreting

pytest.importorskip("triton", reason="needs the triton package (pip install -e '.[test]')")
if torch.cuda.is_available():
    pytest.skip("with CUDA the kernel is tested compiled, in tests/gpu/test_models_cuda.py", allow_module_level=True)
if not interpreting():
    pytest.skip("without CUDA the kernel needs TRITON_INTERPRET=1 set before triton is imported",
                allow_module_level=True)

from affinity_serve.engine.models.fused_moe import align_by_expert, fused_experts, self_test  # noqa: E402
from affinity_serve.engine.models.moe import grouped_experts, route  # noqa: E402
from tests.unit.engine.tiny_hf import tiny_checkpoints  # noqa: E402


def test_alignment_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[0, 2], [2, 1], [0, 2]])                    # pairs 0..5: experts 0 2 2 1 0 2
    sorted_ids, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_ids.tolist()[:12] == [0, 4, pad, pad, 3, pad, pad, pad, 1, 2, 5, pad]
    assert set(sorted_ids.tolist()[12:]) == {pad}
    assert block_expert.tolist()[:3] == [0, 1, 2] and set(block_expert.tolist()[3:]) == {-1}   # expert 3: none


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (13, 6, 2), (40, 4, 3)])
def test_fused_experts_match_the_grouped_path(dtype, tol, t, e, k):
    g = torch.Generator().manual_seed(t + e)
    h, inter = 48, 40                                              # not multiples of the tiles: masks
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.2).to(dtype)
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=k > 2)
    got = fused_experts(x, w13, w2, ids, weights)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), ids, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_self_test_passes_and_the_moe_model_fused_matches_unfused(tmp_path):
    from tests.common.fused_checks import check_fused_model_matches_unfused
    assert self_test("cpu") is None
    path = tiny_checkpoints(tmp_path)["qwen3_moe"]
    from affinity_serve.engine.models.loader import load_model
    model, _ = load_model(path, torch.float32, torch.device("cpu"), 64)
    model.use_fused_ops()
    assert model.layers[0].mlp.experts_fn is fused_experts                 # MoE layer 0; layer 1 is dense
    model.use_fused_ops(False)
    assert model.layers[0].mlp.experts_fn is grouped_experts
    check_fused_model_matches_unfused(path, "cpu", torch.float32, 1e-4)
