"""The Triton paged-attention backend's kernels, run on CPU through Triton's interpreter (TRITON_INTERPRET=1):
against the torch backend on mixed batches (decodes of different lengths, a chunk after cached context, a
fresh prefill), with GQA, head sizes that are not powers of two and several block sizes; and the whole
engine on `attention_backend: triton`, greedy token-identical to transformers through chunked prefill,
prefix hits and preemption. The same kernels compile for CUDA in tests/gpu/test_triton_backend.py."""
from __future__ import annotations

import random

import pytest
import torch

from affinity_serve.engine.attention import build_attention_metadata, select_backend  # noqa: E402
from affinity_serve.engine.attention.torch_paged import TorchPagedAttention, _write_kv  # noqa: E402
from affinity_serve.engine.attention.triton_paged import interpreting  # noqa: E402

pytest.importorskip("triton", reason="needs the triton package (pip install -e '.[test]')")
if torch.cuda.is_available():
    pytest.skip("with CUDA the kernels are tested compiled, in tests/gpu/test_triton_backend.py",
                allow_module_level=True)
if not interpreting():
    pytest.skip("without CUDA the kernels need TRITON_INTERPRET=1 set before triton is imported "
                "(tests/conftest.py does that)", allow_module_level=True)


def _mixed_batch(H, KVH, D, bs, computed, sched, seed=0, dtype=torch.float32):
    """Two caches holding the same context (written through the slot mapping), this step's q/k/v, and
    the metadata; block ids are shuffled so pages are out of order and interleaved between requests."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in zip(computed, sched)]
    ids = list(range(1, sum(need) + 1))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    nb = sum(need) + 1
    full_k = [torch.randn(c + n, KVH, D, generator=g).to(dtype) for c, n in zip(computed, sched)]
    full_v = [torch.randn(c + n, KVH, D, generator=g).to(dtype) for c, n in zip(computed, sched)]
    shape = TorchPagedAttention.kv_cache_shape(nb, bs, KVH, D)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    ctx = [i for i, c in enumerate(computed) if c]
    if ctx:
        pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx], bs)
        for cache in caches:
            _write_kv(torch.cat([full_k[i][:computed[i]] for i in ctx]),
                      torch.cat([full_v[i][:computed[i]] for i in ctx]), cache, pre.slot_mapping)
    q = torch.randn(sum(sched), H, D, generator=g).to(dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, computed)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, computed)])
    return caches, tables, q, k, v


@pytest.mark.parametrize("H,KVH,D,bs", [(4, 2, 8, 4), (8, 2, 64, 16), (6, 6, 80, 16), (14, 2, 64, 16),
                                        (4, 1, 32, 32)],
                         ids=["tiny", "gqa4", "mha-d80", "gqa7", "mqa-bs32"])
def test_triton_matches_torch_backend_on_a_mixed_batch(H, KVH, D, bs):
    computed, sched = [9, 3, 40, 0, 6, 0], [1, 1, 1, 1, 5, 70]     # decodes (one from empty), chunk, prefill
    caches, tables, q, k, v = _mixed_batch(H, KVH, D, bs, computed, sched)
    ref_backend, backend = TorchPagedAttention(cpu_kernels=False), select_backend("triton", "cpu", bs)
    assert backend.name == "triton"
    ref = ref_backend.forward(q, k, v, caches[0], build_attention_metadata(computed, sched, tables, bs), D ** -0.5)
    out = backend.forward(q, k, v, caches[1], build_attention_metadata(computed, sched, tables, bs), D ** -0.5)
    assert torch.equal(caches[0], caches[1])                     # the same KV written to the same slots
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_tiles_longer_than_a_tile_and_decode_only_and_prefill_only_batches():
    """A chunk of 150 after 37 cached tokens spans several query and key tiles (tile edges, the causal
    diagonal inside a tile); decode-only and prefill-only batches take one kernel each."""
    bs = 16
    backend, ref_backend = select_backend("triton", "cpu", bs), TorchPagedAttention(cpu_kernels=False)
    for computed, sched in (([37, 0], [150, 65]), ([5, 100, 63], [1, 1, 1])):
        caches, tables, q, k, v = _mixed_batch(8, 2, 32, bs, computed, sched, seed=3)
        ref = ref_backend.forward(q, k, v, caches[0], build_attention_metadata(computed, sched, tables, bs), 0.2)
        out = backend.forward(q, k, v, caches[1], build_attention_metadata(computed, sched, tables, bs), 0.2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_selection_auto_and_errors(monkeypatch):
    assert select_backend("auto", "cpu", 16).name == "torch"            # auto never picks triton on CPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("triton", "cpu", 16)


def test_auto_on_cuda_takes_triton_only_after_its_self_test(monkeypatch, caplog):
    """What 'auto' picks on a CUDA device (the device itself is not needed to decide): flash where it is
    installed and the block size allows it, triton once its kernels passed the self-test, else torch with a
    warning that says why."""
    from affinity_serve.engine.attention import _auto, flash, triton_paged

    monkeypatch.setattr(flash, "flash_attn_available", lambda: False)
    monkeypatch.setattr(triton_paged, "triton_available", lambda: True)
    monkeypatch.setattr(triton_paged, "self_test", lambda device, bs: None)
    assert _auto("cuda", 16) == "triton" and _auto("cpu", 16) == "torch"
    monkeypatch.setattr(triton_paged, "self_test", lambda device, bs: "RuntimeError: no gcc")
    with caplog.at_level("WARNING"):
        assert _auto("cuda", 16) == "torch"
    assert "no gcc" in caplog.text and "self-test" in caplog.text
    monkeypatch.setattr(flash, "flash_attn_available", lambda: True)
    assert _auto("cuda", 256) == "flash" and _auto("cuda", 16) == "torch"


def test_self_test_passes_here_and_reports_a_failure_in_a_line(monkeypatch):
    from affinity_serve.engine.attention import triton_paged

    assert triton_paged.self_test.__wrapped__("cpu", 16) is None        # the interpreted kernels agree
    assert triton_paged.self_test.__wrapped__("cpu", 5) is None         # an odd block size too

    def broken():
        raise RuntimeError("Failed to compile the launcher\nlong log")
    monkeypatch.setattr(triton_paged, "_kernels", broken)
    assert triton_paged.self_test.__wrapped__("cpu", 16) == "RuntimeError: Failed to compile the launcher"


GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(10, 700) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_engine_on_triton_matches_transformers(checkpoints, hf_reference, name):
    """The whole engine on the interpreted kernels: mixed batches under a tiny token budget (chunked
    prefill after cached context), then a shared prefix (prefix hits)."""
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints[name]
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 64, "block_size": 8},
              scheduler={"max_num_batched_tokens": 16})
    assert llm.engine.runner.backend.name == "triton"
    prompts = _prompts(3, 1, 40, seed=11)
    prefix = _prompts(1, 30, 30, seed=12)[0]
    prompts += [prefix + [11, 12], prefix + [21, 22, 23]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 6) for p in prompts]
    assert llm.engine.last_stats.prefix_cache_hits_total > 0


def test_engine_on_triton_through_preemption(checkpoints, hf_reference):
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints["llama"]
    # 4 prompts of 6-10 tokens, 8 tokens each, in 7 usable blocks of 4 (28 tokens): 3 preemptions, each
    # recomputed on the kernels (the interpreter costs ~0.3 s a step, so the pool and lengths are small)
    prompts = _prompts(4, 6, 10, seed=4)
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 8, "block_size": 4})
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert llm.engine.last_stats.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 8) for p in prompts]
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


# ---------------------------------------------------------------- cascade decode (a prefix shared by the batch)
def _launches(monkeypatch):
    """The names of the Triton kernels launched from here on, in order."""
    from affinity_serve.engine.attention import triton_paged

    kernels, calls = triton_paged._kernels(), []

    class Spy:
        def __getattr__(self, name):
            kernel = getattr(kernels, name)

            class Launcher:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        calls.append(name)
                        return kernel[grid](*args, **kwargs)
                    return launch
            return Launcher()
    monkeypatch.setattr(triton_paged, "_kernels", lambda: Spy())
    return calls


def _shared_prefix_batch(H, KVH, D, bs, prefix_blocks, suffix_computed, prefills, seed=0):
    """Decodes whose block tables start with the same `prefix_blocks` pages (one copy of the prefix's K/V in
    the cache), each with `suffix_computed[i]` more cached tokens of its own, then prefill chunks
    (computed, scheduled). Two caches with the same contents; q/k/v of the step; the metadata inputs."""
    g = torch.Generator().manual_seed(seed)
    nd, plen = len(suffix_computed), prefix_blocks * bs
    computed = [plen + c for c in suffix_computed] + [c for c, _ in prefills]
    sched = [1] * nd + [n for _, n in prefills]
    shared, nxt, tables = list(range(1, prefix_blocks + 1)), prefix_blocks + 1, []
    for i, (c, n) in enumerate(zip(computed, sched)):
        own = -(-(c + n) // bs) - (prefix_blocks if i < nd else 0)
        tables.append((shared if i < nd else []) + list(range(nxt, nxt + own)))
        nxt += own
    pk, pv = torch.randn(plen, KVH, D, generator=g), torch.randn(plen, KVH, D, generator=g)
    full = []
    for i, (c, n) in enumerate(zip(computed, sched)):
        k, v = torch.randn(c + n, KVH, D, generator=g), torch.randn(c + n, KVH, D, generator=g)
        if i < nd:
            k[:plen], v[:plen] = pk, pv
        full.append((k, v))
    caches = [torch.zeros(TorchPagedAttention.kv_cache_shape(nxt, bs, KVH, D)) for _ in range(2)]
    ctx = [i for i, c in enumerate(computed) if c]
    pre = build_attention_metadata([0] * len(ctx), [computed[i] for i in ctx], [tables[i] for i in ctx], bs)
    for cache in caches:
        _write_kv(torch.cat([full[i][0][:computed[i]] for i in ctx]),
                  torch.cat([full[i][1][:computed[i]] for i in ctx]), cache, pre.slot_mapping)
    q = torch.randn(sum(sched), H, D, generator=g)
    k = torch.cat([kv[0][c:] for kv, c in zip(full, computed)])
    v = torch.cat([kv[1][c:] for kv, c in zip(full, computed)])
    return caches, (computed, sched, tables, bs), q, k, v


@pytest.mark.parametrize("H,KVH,D,bs,prefix_blocks,suffix,prefills", [
    (8, 2, 64, 16, 5, [3, 17, 40, 0], [(0, 20)]),           # GQA 4, a suffix of one key, a prefill after
    (6, 6, 80, 4, 20, [1, 2, 3], []),                       # MHA, d 80, 80 prefix tokens over tile edges
    (14, 2, 64, 16, 9, [5] * 9, [(7, 30)]),                 # GQA 7: 63 prefix rows in one program
    (4, 1, 32, 16, 4, [70, 0], []),                         # MQA, a suffix longer than the prefix
    (14, 2, 32, 12, 6, list(range(20)), []),                # 140 rows: three row tiles; block size 12
], ids=["gqa4", "mha-d80-bs4", "gqa7", "mqa", "gqa7-3-tiles"])
def test_cascade_decode_matches_the_torch_backend(monkeypatch, H, KVH, D, bs, prefix_blocks, suffix, prefills):
    """Decodes that share their first pages read them once for the batch (decode_prefix), their own keys in
    decode_split from the prefix's end, and one merge over both: the torch backend's result in float32."""
    caches, inputs, q, k, v = _shared_prefix_batch(H, KVH, D, bs, prefix_blocks, suffix, prefills)
    ref = TorchPagedAttention(cpu_kernels=False, cascade_min_tokens=None).forward(     # reads every key itself
        q, k, v, caches[0], build_attention_metadata(*inputs), D ** -0.5)
    backend = select_backend("triton", "cpu", bs)
    backend.cascade_min_tokens = 16
    meta = build_attention_metadata(*inputs)
    assert meta.num_common_prefix_blocks == prefix_blocks
    calls = _launches(monkeypatch)
    out = backend.forward(q, k, v, caches[1], meta, D ** -0.5)
    assert calls.count("decode_prefix") == 1 and calls.count("decode_split") == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cascade_needs_cascade_min_tokens_of_shared_pages(monkeypatch):
    """A shorter shared prefix, a single decode, or the switch off (None): the plain decode kernels."""
    backend = select_backend("triton", "cpu", 16)
    calls = _launches(monkeypatch)
    for least, suffix in ((80, [3, 9]), (16, [3]), (None, [3, 9])):       # 64 tokens shared
        backend.cascade_min_tokens = least
        caches, inputs, q, k, v = _shared_prefix_batch(4, 2, 32, 16, 4, suffix, [])
        ref = TorchPagedAttention(cpu_kernels=False, cascade_min_tokens=None).forward(
            q, k, v, caches[0], build_attention_metadata(*inputs), 0.2)
        torch.testing.assert_close(backend.forward(q, k, v, caches[1], build_attention_metadata(*inputs), 0.2), ref,
                                   rtol=1e-5, atol=1e-5)
    assert "decode_prefix" not in calls and len(calls) > 3
    backend.cascade_min_tokens = 64
    backend.forward(q, k, v, caches[1], build_attention_metadata(*inputs), 0.2)
    assert calls[-2] == "decode_prefix"                                  # exactly at the threshold: cascade


def test_engine_on_triton_with_cascade_decode_matches_transformers(monkeypatch, checkpoints, hf_reference):
    """Requests that hit a cached 40-token prefix decode together in cascade (eager steps): transformers'
    tokens, and every block back in the pool."""
    from affinity_serve.engine import LLM, SamplingParams

    path = checkpoints["llama"]
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 64, "block_size": 8})
    llm.engine.runner.backend.cascade_min_tokens = 16
    prefix = _prompts(1, 40, 40, seed=21)[0]
    llm.generate([prefix + [5]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)    # caches the prefix
    prompts = [prefix + tail for tail in _prompts(4, 1, 12, seed=22)]
    calls = _launches(monkeypatch)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=5 + 2 * i, **GREEDY) for i in range(4)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 5 + 2 * i) for i, p in enumerate(prompts)]
    assert calls.count("decode_prefix") >= 4 * len(llm.engine.runner.kv_caches)      # 4+ steps in cascade
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
