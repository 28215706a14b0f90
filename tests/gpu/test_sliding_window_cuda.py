"""Sliding-window KV-cache groups on CUDA (issue 31): Mistral, Gemma 2 and Gemma 3 float32 greedy token-identical
to transformers past their windows on the torch backend (per-group tables, dropped blocks, prefix hits), and the
flash-attn backend's window / soft-cap arguments against the torch backend at the attention level (skipped
without flash-attn, which has no wheel for the lent machines). Skipped cleanly without CUDA."""
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WINDOW = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.unit.engine.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("sliding_cuda")
    return {
        "mistral": str(write_tiny_hf(root / "mistral", "MistralConfig", seed=11, sliding_window=WINDOW)),
        "gemma3": str(write_tiny_hf(root / "gemma3", "Gemma3TextConfig", seed=22, num_hidden_layers=3, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        "gemma2": str(write_tiny_hf(root / "gemma2", "Gemma2Config", seed=5, num_hidden_layers=4, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=WINDOW, initializer_range=0.1,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=2.0)),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_float32_past_the_window_is_token_identical_to_transformers(checkpoints, hf_reference, name, backend):
    from affinity_serve.engine import LLM, SamplingParams
    if backend == "triton":
        pytest.importorskip("triton")
    path = checkpoints[name]
    llm = LLM(path, device="cuda", dtype="float32", cache={"num_blocks": 64, "block_size": 16},
              scheduler={"max_num_batched_tokens": 48}, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    assert llm.engine.runner.decode_graphs is None            # a table per KV-cache group: decode runs eager
    rng = random.Random(3)
    shared = [rng.randrange(10, 700) for _ in range(40)]
    prompts = [shared + [rng.randrange(10, 700) for _ in range(rng.randint(5, 60))] for _ in range(5)]
    n = 24
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, n) for p in prompts]
    kv = llm.engine.kv_cache_manager
    assert kv.stats.hits > 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_flash_window_matches_torch(softcap):
    from affinity_serve.engine.attention.flash import flash_attn_available
    if not flash_attn_available():
        pytest.skip("flash-attn is not installed")
    from affinity_serve.engine.attention.base import build_attention_metadata
    from affinity_serve.engine.attention.flash import FlashPagedAttention
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    torch.manual_seed(0)
    bs, kvh, heads, d, nb, window = 256, 2, 8, 64, 12, 300
    starts, lens = [700, 0, 400], [701, 500, 660]                   # a decode, a fresh prompt, a chunk
    tables = [[1, 2, 3], [4, 5], [6, 7, 8]]
    nulled = [[0 if j < max(0, s - window + 1) // bs else b for j, b in enumerate(t)] for t, s in zip(tables, starts)]
    meta = build_attention_metadata(starts, [n - s for n, s in zip(lens, starts)], nulled, bs, "cuda",
                                    sliding_window=window)
    flash, ref = FlashPagedAttention(bs), TorchPagedAttention(cpu_kernels=False)
    kv_flash = torch.randn(flash.kv_cache_shape(nb, bs, kvh, d), device="cuda", dtype=torch.bfloat16)
    kv_torch = kv_flash.permute(0, 3, 1, 2, 4).contiguous()        # NHD pages -> head-major
    q = torch.randn(meta.num_tokens, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(meta.num_tokens, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    got = flash.forward(q, k, v, kv_flash, meta, d ** -0.5, softcap)
    want = ref.forward(q, k, v, kv_torch, meta, d ** -0.5, softcap)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
