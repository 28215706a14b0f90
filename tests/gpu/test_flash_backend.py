"""flash-attn backend on a real GPU: same tokens as the torch backend. Skipped cleanly without CUDA."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flash_matches_torch_backend_greedy(checkpoints):
    pytest.importorskip("flash_attn", reason="needs the flash-attn package (pip install '.[gpu]')")
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints["llama"]
    prompts = [[10 + i for i in range(n)] for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "flash"):
        llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend=backend,
                  cache={"block_size": 256, "num_blocks": 16})
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["flash"] == outs["torch"]


def test_torch_backend_on_gpu_matches_transformers(checkpoints, hf_reference):
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints["qwen2"]
    ids = [11, 22, 33, 44, 55, 66, 77]
    llm = LLM(path, device="cuda", dtype="float32", attention_backend="torch", cache={"num_blocks": 64})
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_reference(path, ids, 8)


def test_flash_backend_matches_torch_backend_on_a_mixed_batch():
    """Kernel level, fp16 on the GPU: context written by a prefill pass, then decodes, a chunk after
    cached context and a fresh prefill in one batch; both backends read their own cache layouts."""
    pytest.importorskip("flash_attn", reason="needs the flash-attn package (pip install '.[gpu]')")
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.flash import FlashPagedAttention
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention

    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    H, KVH, D, bs, nb = 8, 2, 64, 256, 8
    backends = [TorchPagedAttention(cpu_kernels=False), FlashPagedAttention(bs)]
    caches = [torch.zeros(b.kv_cache_shape(nb, bs, KVH, D), dtype=dt, device=dev) for b in backends]
    computed, sched = [300, 17, 260, 0], [1, 1, 40, 90]
    tables = [[3, 1], [5], [2, 6], [7]]
    total = [c + n for c, n in zip(computed, sched)]
    ks = [torch.randn(t, KVH, D, generator=g).to(dev, dt) for t in total]
    vs = [torch.randn(t, KVH, D, generator=g).to(dev, dt) for t in total]
    pre = build_attention_metadata([0, 0, 0], computed[:3], tables[:3], bs, dev)
    meta = build_attention_metadata(computed, sched, tables, bs, dev)
    q_pre = torch.randn(sum(computed[:3]), H, D, generator=g).to(dev, dt)
    q = torch.randn(sum(sched), H, D, generator=g).to(dev, dt)
    k_pre = torch.cat([k[:c] for k, c in zip(ks, computed[:3])])
    v_pre = torch.cat([v[:c] for v, c in zip(vs, computed[:3])])
    k_new = torch.cat([k[c:] for k, c in zip(ks, computed)])
    v_new = torch.cat([v[c:] for v, c in zip(vs, computed)])
    outs = []
    for backend, cache in zip(backends, caches):
        backend.forward(q_pre, k_pre, v_pre, cache, pre, D ** -0.5)
        outs.append(backend.forward(q, k_new, v_new, cache, meta, D ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)
