"""The Triton paged-attention backend's kernels, run on CPU through Triton's interpreter (TRITON_INTERPRET=1):
against the torch backend on mixed batches (decodes of different lengths, a chunk after cached context, a
fresh prefill), with GQA, head sizes that are not powers of two and several block sizes; and the whole
engine on `attention_backend: triton`, greedy token-identical to transformers through chunked prefill,
prefix hits and preemption. The same kernels compile for CUDA in tests/gpu/test_triton_backend.py."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention import build_attention_metadata, select_backend  # noqa: E402
from engine.attention.torch_paged import TorchPagedAttention, _write_kv  # noqa: E402
from engine.attention.triton_paged import interpreting  # noqa: E402

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
    from engine.attention import _auto, flash, triton_paged

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
    from engine.attention import triton_paged

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
    from engine import LLM, SamplingParams

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
    from engine import LLM, SamplingParams

    path = checkpoints["llama"]
    prompts = _prompts(4, 10, 20, seed=4)
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 12, "block_size": 4})
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    assert llm.engine.last_stats.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 16) for p in prompts]
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
