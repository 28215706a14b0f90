"""The GPU path's fused Triton ops (engine/models/fused.py) and the split-K decode kernels, on CPU through
Triton's interpreter: each against the torch op it replaces, in float32 (to float32 rounding) and bfloat16
(the residual sum bit-exact, the rest within one bf16 step); the whole model with fused ops against the
unfused one. tests/gpu/test_fused_ops.py runs the same checks compiled on CUDA."""
from __future__ import annotations

import pytest
import torch

from affinity_serve.engine.attention.triton_paged import interpreting

pytest.importorskip("triton", reason="needs the triton package (pip install -e '.[test]')")
if torch.cuda.is_available():
    pytest.skip("with CUDA these kernels are tested compiled, in tests/gpu/test_fused_ops.py", allow_module_level=True)
if not interpreting():
    pytest.skip("without CUDA the kernels need TRITON_INTERPRET=1 set before triton is imported",
                allow_module_level=True)

from tests.common.fused_checks import (check_add_rms_norm, check_decode_splits,  # noqa: E402
                                       check_fused_model_matches_unfused, check_rope, check_silu_mul)

DEV = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add+norm"])
def test_add_rms_norm_matches_the_torch_ops(dtype, with_delta):
    check_add_rms_norm(DEV, dtype, with_delta, rows=5, hidden=80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_rotates_q_and_k_in_one_view_of_the_projection(dtype):
    check_rope(DEV, dtype, tokens=6, heads=3, kv_heads=1, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_matches_the_torch_ops(dtype):
    check_silu_mul(DEV, dtype, rows=3, inter=40)


@pytest.mark.parametrize("nd,lens", [(1, [3]), (1, [200]), (2, [1, 130]), (4, [17, 64, 65, 5])],
                         ids=["one-key-8-splits", "long-8-splits", "4-splits-one-key", "2-splits"])
def test_split_k_decode_matches_the_torch_backend(nd, lens):
    """Splits with no keys (a 3-token sequence over 8 splits), split edges on and off the 64-key tiles."""
    check_decode_splits(DEV, torch.float32, lens, heads=4, kv_heads=2, head_dim=32, block_size=16, tol=1e-5)


def test_the_model_with_fused_ops_matches_the_unfused_model(checkpoints):
    check_fused_model_matches_unfused(checkpoints["qwen2"], DEV, torch.float32, tol=1e-5)


def test_self_test_passes_here_and_a_failing_kernel_leaves_the_torch_ops_on(checkpoints, hf_reference, monkeypatch,
                                                                           caplog):
    """The engine switches the fused ops on only after their start-up self-test: a kernel that cannot compile
    costs a warning, not the replica (the model then runs its torch ops, still token-exact)."""
    from affinity_serve.engine import LLM, SamplingParams
    from affinity_serve.engine.models import fused

    assert fused.self_test.__wrapped__("cpu") is None
    assert LLM(checkpoints["llama"], attention_backend="triton", cache={"num_blocks": 16}).engine.runner.model.fused

    def broken():
        raise RuntimeError("Failed to compile the launcher\nlong log")
    monkeypatch.setattr(fused, "_k", broken)
    fused.self_test.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            llm = LLM(checkpoints["llama"], attention_backend="triton", cache={"num_blocks": 16})
    finally:
        fused.self_test.cache_clear()
    assert "fused Triton ops failed their self-test" in caplog.text and "Failed to compile" in caplog.text
    assert llm.engine.runner.backend.name == "triton" and not llm.engine.runner.model.fused
    prompt = [12, 40, 7, 300, 5]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_reference(checkpoints["llama"], prompt, 5)
