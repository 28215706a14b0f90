"""The fused Triton ops (engine/models/fused.py) and the split-K decode kernels compiled for a real GPU,
against the torch ops they replace: float32 to float32 rounding, bfloat16 within one rounding step (the
residual sum bit-exact), at a 1B model's sizes. tests/unit/engine/test_fused_ops.py runs the same checks
through Triton's interpreter on CPU. Skipped cleanly without CUDA or triton."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


@pytest.fixture(autouse=True)
def _triton():
    pytest.importorskip("triton", reason="needs the triton package")


@DTYPES
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add+norm"])
def test_add_rms_norm_on_cuda(dtype, with_delta):
    from tests.common.fused_checks import check_add_rms_norm
    check_add_rms_norm("cuda", getattr(torch, dtype), with_delta, rows=33, hidden=2048)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_on_cuda(dtype, head_dim):
    from tests.common.fused_checks import check_rope
    check_rope("cuda", getattr(torch, dtype), tokens=40, heads=32, kv_heads=8, head_dim=head_dim)


@DTYPES
def test_silu_mul_on_cuda(dtype):
    from tests.common.fused_checks import check_silu_mul
    check_silu_mul("cuda", getattr(torch, dtype), rows=7, inter=8192)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("lens", [[3], [600], [1, 130, 2000], [17, 64, 65, 5]])
def test_split_k_decode_on_cuda(dtype, tol, lens):
    from tests.common.fused_checks import check_decode_splits
    check_decode_splits("cuda", getattr(torch, dtype), lens, heads=32, kv_heads=8, head_dim=64, block_size=16,
                        tol=tol)


def test_the_model_with_fused_ops_matches_the_unfused_model_on_cuda(checkpoints):
    from tests.common.fused_checks import check_fused_model_matches_unfused
    check_fused_model_matches_unfused(checkpoints["llama"], "cuda", torch.float32, tol=1e-4)
