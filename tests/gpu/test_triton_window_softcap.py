"""Sliding windows and soft-capped scores in the Triton kernels, compiled for a real GPU (issue 31): against the
torch backend (fp32 within 1e-5, bf16 within its resolution) on mixed batches with the null block where windows
have passed (filled with garbage), one-kernel and split-K decode, prefill tiles whose rows' windows start past
the first key tile; and `auto` on CUDA taking triton for a sliding-window model once its self-test (which now
covers a window and a cap) passed. The same kernels run on CPU through Triton's interpreter in
tests/unit/engine/test_triton_window_softcap.py. Skipped cleanly without CUDA or triton."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch(H, KVH, D, bs, computed, sched, window, dtype, seed=0):
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention, _write_kv
    from affinity_serve.engine.kv_groups import window_start_block

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in zip(computed, sched)]
    ids = torch.randperm(sum(need), generator=g).add(1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    ks = [torch.randn(c + n, KVH, D, generator=g).to(dev, dtype) for c, n in zip(computed, sched)]
    vs = [torch.randn(c + n, KVH, D, generator=g).to(dev, dtype) for c, n in zip(computed, sched)]
    caches = [torch.zeros(TorchPagedAttention.kv_cache_shape(sum(need) + 1, bs, KVH, D), dtype=dtype, device=dev)
              for _ in range(2)]
    ctx = [i for i, c in enumerate(computed) if c]
    pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx], bs, dev)
    junk = (torch.randn(caches[0][:, :, 0].shape, generator=g) * 1e3).to(dev, dtype)
    for cache in caches:
        _write_kv(torch.cat([ks[i][:computed[i]] for i in ctx]), torch.cat([vs[i][:computed[i]] for i in ctx]),
                  cache, pre.slot_mapping)
        cache[:, :, 0] = junk                              # the null block: never read unmasked
    if window is not None:
        tables = [[0] * window_start_block(c, window, bs) + t[window_start_block(c, window, bs):]
                  for t, c in zip(tables, computed)]
    q = torch.randn(sum(sched), H, D, generator=g).to(dev, dtype)
    k = torch.cat([x[c:] for x, c in zip(ks, computed)])
    v = torch.cat([x[c:] for x, c in zip(vs, computed)])
    return caches, tables, q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,softcap", [(64, None), (300, None), (None, 50.0), (512, 30.0)])
@pytest.mark.parametrize("H,KVH,D,bs", [(8, 2, 64, 16), (32, 8, 128, 16), (16, 16, 64, 32)])
def test_triton_window_and_softcap_match_torch_on_cuda(H, KVH, D, bs, window, softcap, dtype, tol):
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention

    computed, sched = [300, 17, 1000, 0, 260, 0], [1, 1, 1, 1, 40, 333]
    caches, tables, q, k, v = _batch(H, KVH, D, bs, computed, sched, window, dtype)

    def meta():
        return build_attention_metadata(computed, sched, tables, bs, "cuda", sliding_window=window)
    want = TorchPagedAttention(cpu_kernels=False).forward(q, k, v, caches[0], meta(), D ** -0.5, softcap)
    for backend in (TritonPagedAttention(), TritonPagedAttention(max_splits=1)):    # split-K and one kernel
        got = backend.forward(q, k, v, caches[1], meta(), D ** -0.5, softcap)
        assert torch.isfinite(got.float()).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_auto_takes_triton_for_a_sliding_window_model_after_its_self_test():
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import flash, select_backend
    from affinity_serve.engine.attention.triton_paged import self_test
    assert self_test.__wrapped__("cuda", 16) is None
    if not flash.flash_attn_available():
        assert select_backend("auto", "cuda", 16, sliding_window=True, softcap=True).name == "triton"
