"""The new architectures and the Triton fused-MoE kernel on CUDA (issue 31): the kernel compiled against the
grouped torch path at a Qwen3-30B-A3B layer's sizes; a MoE model with every fused op against the unfused
one; Qwen3, Qwen3-MoE, Mixtral, Phi-3 and Gemma 3 float32 greedy token-identical to transformers on both attention
backends (triton: fused ops, fused MoE and CUDA-graph decode). Skipped cleanly without CUDA."""
import random
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.unit.engine.tiny_hf import tiny_checkpoints
    return tiny_checkpoints(tmp_path_factory.mktemp("tiny_hf"))


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_fused_experts_on_cuda(dtype, tol, tokens):
    pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine.models.fused_moe import fused_experts, self_test
    from affinity_serve.engine.models.moe import grouped_experts, route
    assert self_test("cuda") is None
    g = torch.Generator(device="cuda").manual_seed(tokens)
    h, inter, e, k = 2048, 768, 128, 8                      # a Qwen3-30B-A3B MoE layer
    dt = getattr(torch, dtype)
    x = torch.randn(tokens, h, device="cuda", generator=g).to(dt)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).to(dt)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).to(dt)
    weights, ids = route(torch.randn(tokens, e, device="cuda", generator=g), k, True)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), ids, weights)
    got = fused_experts(x, w13, w2, ids, weights)
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.float() / scale, ref / scale, rtol=tol, atol=tol)
    times = {}
    for name, fn in (("fused", fused_experts), ("grouped", grouped_experts)):
        fn(x, w13, w2, ids, weights)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(x, w13, w2, ids, weights)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 10 * 1e3
    print(f"MoE layer {dtype} T={tokens}: fused {times['fused']:.3f} ms, grouped {times['grouped']:.3f} ms")


def test_moe_model_fused_matches_unfused_on_cuda(tiny):
    """float32 only: in bfloat16 a few tokens of this random model sit near a tie between two experts, and the
    fused and unfused paths' different rounding of the router's input sends them to different experts (seen on
    an H200: 97 of 3648 hidden values apart). The kernel's bfloat16 accuracy is the test above."""
    pytest.importorskip("triton", reason="needs the triton package")
    from tests.common.fused_checks import check_fused_model_matches_unfused
    check_fused_model_matches_unfused(tiny["qwen3_moe"], "cuda", torch.float32, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "gemma3"])
def test_float32_is_token_identical_to_transformers(tiny, hf_reference, name, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine import LLM, SamplingParams
    from affinity_serve.engine.models.fused_moe import fused_experts
    path = tiny[name]
    llm = LLM(path, device="cuda", dtype="float32", attention_backend=backend,
              cache={"num_blocks": 48, "block_size": 16}, scheduler={"max_num_batched_tokens": 64})
    model = llm.engine.runner.model
    moe_layers = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts_fn")]
    if backend == "triton":
        # captured, MoE included; not for Gemma 3's KV-cache groups (a graph holds one table per request)
        assert (llm.engine.runner.decode_graphs is None) == (name == "gemma3")
        assert all(m.experts_fn is fused_experts for m in moe_layers)
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 700) for _ in range(rng.randint(3, 90))] for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 12) for p in prompts]
