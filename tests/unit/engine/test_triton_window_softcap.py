"""Sliding-window attention and logit soft-capping in the Triton kernels (issue 31), run on CPU through Triton's
interpreter against the torch backend: decodes past the window (one kernel, and split-K), a chunk after cached
context, prefills longer than a query tile whose rows' windows start past the first key tile, block tables with
the null block where the window has passed (filled with garbage here: reading it would show); then the whole
engine on `attention_backend: triton` token-exact against transformers on tiny Gemma 3 (sliding window) and
Gemma 2 (window and soft-cap). Compiled for CUDA in tests/gpu/test_triton_window_softcap.py."""
from __future__ import annotations

import random

import pytest
import torch

from affinity_serve.engine.attention import build_attention_metadata, select_backend
from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
from affinity_serve.engine.attention.triton_paged import interpreting
from affinity_serve.engine.kv_groups import window_start_block

pytest.importorskip("triton", reason="needs the triton package (pip install -e '.[test]')")
if torch.cuda.is_available():
    pytest.skip("with CUDA the kernels are tested compiled, in tests/gpu/test_triton_window_softcap.py",
                allow_module_level=True)
if not interpreting():
    pytest.skip("without CUDA the kernels need TRITON_INTERPRET=1 set before triton is imported "
                "(tests/conftest.py does that)", allow_module_level=True)

from tests.unit.engine.test_triton_backend import _mixed_batch  # noqa: E402


def _drop_outside_windows(caches, tables, computed, window, bs, seed=0):
    """Tables as a sliding group's are: the null block (0) before each request's window; block 0 full of
    large values, so a kernel that reads a key there unmasked gives a visibly wrong output."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(caches[0][:, :, 0].shape, generator=g) * 1e3
    for cache in caches:
        cache[:, :, 0] = junk
    return [[0] * window_start_block(c, window, bs) + t[window_start_block(c, window, bs):]
            for t, c in zip(tables, computed)]


def _compare(H, KVH, D, bs, computed, sched, window, softcap, seed=0):
    caches, tables, q, k, v = _mixed_batch(H, KVH, D, bs, computed, sched, seed=seed)
    if window is not None:
        tables = _drop_outside_windows(caches, tables, computed, window, bs, seed)
    ref_backend, backend = TorchPagedAttention(cpu_kernels=False), select_backend("triton", "cpu", bs)

    def meta():
        return build_attention_metadata(computed, sched, tables, bs, sliding_window=window)
    ref = ref_backend.forward(q, k, v, caches[0], meta(), D ** -0.5, softcap)
    out = backend.forward(q, k, v, caches[1], meta(), D ** -0.5, softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    return out


@pytest.mark.parametrize("window", [None, 5, 16, 33])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("H,KVH,D,bs", [(8, 2, 32, 8), (8, 8, 16, 4)], ids=["gqa-split-k", "mha-one-kernel"])
def test_window_and_softcap_match_the_torch_backend(H, KVH, D, bs, window, softcap):
    """Decodes shorter and longer than the window, a chunk after cached context that crosses it, a fresh prefill
    of 150 (three query tiles of 64: the last rows' windows start two key tiles in)."""
    if window is None and softcap is None:
        pytest.skip("the plain kernels: tests/unit/engine/test_triton_backend.py")
    computed, sched = [9, 3, 70, 0, 40, 0], [1, 1, 1, 1, 20, 150]
    _compare(H, KVH, D, bs, computed, sched, window, softcap)


def test_the_window_changes_the_output():
    """The comparison above is not vacuous: with a window the same batch attends differently."""
    computed, sched = [40, 0], [1, 70]
    a = _compare(4, 2, 16, 8, computed, sched, None, None, seed=2)
    b = _compare(4, 2, 16, 8, computed, sched, 8, None, seed=2)
    assert not torch.allclose(a, b, atol=1e-3)


def test_auto_and_triton_accept_sliding_window_and_softcap_models():
    backend = select_backend("triton", "cpu", 16, sliding_window=True, softcap=True)
    assert backend.name == "triton" and backend.supports_sliding_window and backend.supports_softcap


# ---------------------------------------------------------------- the engine on the interpreted kernels
WINDOW = 16


@pytest.fixture(scope="module")
def tiny_window_models(tmp_path_factory):
    from tests.unit.engine.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("triton_window")
    return {
        "gemma3": str(write_tiny_hf(root / "gemma3", "Gemma3TextConfig", seed=22, num_hidden_layers=3, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        "gemma2": str(write_tiny_hf(root / "gemma2", "Gemma2Config", seed=5, num_hidden_layers=4, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, initializer_range=0.1,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=2.0)),
    }


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_engine_on_triton_matches_transformers_past_the_window(tiny_window_models, hf_reference, name):
    from affinity_serve.engine import LLM, SamplingParams

    path = tiny_window_models[name]
    llm = LLM(path, attention_backend="triton", cache={"num_blocks": 64, "block_size": 8},
              scheduler={"max_num_batched_tokens": 24})
    assert llm.engine.runner.backend.name == "triton"
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 700) for _ in range(rng.randint(20, 45))] for _ in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 6) for p in prompts]
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
