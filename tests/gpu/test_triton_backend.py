"""The Triton paged-attention backend compiled for a real GPU: the kernels against the torch backend (fp32:
within 1e-5; bf16: within bf16's resolution) on mixed batches, and the engine on it greedy token-identical to
transformers in fp32. The same kernels are checked on CPU through Triton's interpreter in
tests/unit/engine/test_triton_backend.py. Skipped cleanly without CUDA or triton."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H,KVH,D,bs", [(8, 2, 64, 16), (32, 8, 64, 16), (12, 2, 128, 16), (6, 6, 80, 32)])
def test_triton_matches_torch_backend_on_cuda(H, KVH, D, bs, dtype, tol):
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention, _write_kv
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    computed, sched = [300, 17, 1000, 0, 260, 0], [1, 1, 1, 1, 40, 333]
    need = [-(-(c + n) // bs) for c, n in zip(computed, sched)]
    ids = torch.randperm(sum(need), generator=g).add(1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    nb = sum(need) + 1
    ks = [torch.randn(c + n, KVH, D, generator=g).to(dev, dtype) for c, n in zip(computed, sched)]
    vs = [torch.randn(c + n, KVH, D, generator=g).to(dev, dtype) for c, n in zip(computed, sched)]
    shape = TorchPagedAttention.kv_cache_shape(nb, bs, KVH, D)
    caches = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(2)]
    ctx = [i for i, c in enumerate(computed) if c]
    pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx], bs, dev)
    for cache in caches:
        _write_kv(torch.cat([ks[i][:computed[i]] for i in ctx]), torch.cat([vs[i][:computed[i]] for i in ctx]),
                  cache, pre.slot_mapping)
    q = torch.randn(sum(sched), H, D, generator=g).to(dev, dtype)
    k = torch.cat([x[c:] for x, c in zip(ks, computed)])
    v = torch.cat([x[c:] for x, c in zip(vs, computed)])
    ref = TorchPagedAttention(cpu_kernels=False).forward(
        q, k, v, caches[0], build_attention_metadata(computed, sched, tables, bs, dev), D ** -0.5)
    out = TritonPagedAttention().forward(q, k, v, caches[1], build_attention_metadata(computed, sched, tables, bs, dev),
                                         D ** -0.5)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_engine_on_triton_matches_transformers_fp32(checkpoints, hf_reference, name):
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints[name]
    prompts = [[10 + (7 * i + j) % 600 for j in range(n)] for i, n in enumerate((5, 40, 300, 33))]
    llm = LLM(path, device="cuda", dtype="float32", attention_backend="triton",
              cache={"memory_budget_bytes": 256 << 20}, scheduler={"max_num_batched_tokens": 64})
    assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.model.fused   # self-tests passed
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 12) for p in prompts]


def test_auto_picks_triton_on_cuda_without_flash_attn():
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import select_backend
    from affinity_serve.engine.attention.flash import flash_attn_available

    expected = "flash" if flash_attn_available() else "triton"
    assert select_backend("auto", "cuda", 256).name == expected
    assert select_backend("auto", "cuda", 16).name == "triton"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nd,H,KVH,D", [(32, 32, 8, 64), (5, 14, 2, 64), (128, 32, 8, 64)])
def test_cascade_decode_matches_torch_backend_on_cuda(nd, H, KVH, D, dtype, tol):
    """Decodes sharing a 512-token prefix (the same pages) read it once for the batch (decode_prefix): the
    torch backend's result (which runs its own cascade) within fp32 / bf16 tolerance, and the plain kernels'."""
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention, _write_kv
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention

    dev, bs, plen = torch.device("cuda"), 16, 512
    g = torch.Generator().manual_seed(1)
    own = torch.randint(1, 200, (nd,), generator=g).tolist()            # each request's cached suffix
    computed, sched = [plen + n for n in own] + [100], [1] * nd + [50]  # and a prefill chunk after them
    shared, nxt, tables = list(range(1, plen // bs + 1)), plen // bs + 1, []
    for i, (c, n) in enumerate(zip(computed, sched)):
        extra = -(-(c + n) // bs) - (len(shared) if i < nd else 0)
        tables.append((shared if i < nd else []) + list(range(nxt, nxt + extra)))
        nxt += extra
    pk, pv = torch.randn(plen, KVH, D, generator=g), torch.randn(plen, KVH, D, generator=g)
    ks, vs = [], []
    for i, (c, n) in enumerate(zip(computed, sched)):
        k, v = torch.randn(c + n, KVH, D, generator=g), torch.randn(c + n, KVH, D, generator=g)
        if i < nd:
            k[:plen], v[:plen] = pk, pv
        ks.append(k.to(dev, dtype))
        vs.append(v.to(dev, dtype))
    caches = [torch.zeros(TorchPagedAttention.kv_cache_shape(nxt, bs, KVH, D), dtype=dtype, device=dev)
              for _ in range(3)]
    pre = build_attention_metadata([0] * len(computed), computed, tables, bs, dev)
    for cache in caches:
        _write_kv(torch.cat([x[:c] for x, c in zip(ks, computed)]), torch.cat([x[:c] for x, c in zip(vs, computed)]),
                  cache, pre.slot_mapping)
    q = torch.randn(sum(sched), H, D, generator=g).to(dev, dtype)
    k = torch.cat([x[c:] for x, c in zip(ks, computed)])
    v = torch.cat([x[c:] for x, c in zip(vs, computed)])
    meta = lambda: build_attention_metadata(computed, sched, tables, bs, dev)  # noqa: E731
    assert meta().num_common_prefix_blocks == plen // bs
    ref = TorchPagedAttention(cpu_kernels=False).forward(q, k, v, caches[0], meta(), D ** -0.5)
    cascade = TritonPagedAttention()
    m = meta()
    out = cascade.forward(q, k, v, caches[1], m, D ** -0.5)
    assert "cascade_len" in m.backend_cache                                     # it took the cascade path
    plain = TritonPagedAttention(cascade_min_tokens=None).forward(q, k, v, caches[2], meta(), D ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), plain.float(), rtol=tol, atol=tol)
