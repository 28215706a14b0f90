"""The architecture registry, token-exact against transformers greedy on tiny random checkpoints that
transformers itself wrote (hub tensor names): Qwen3, Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral, Phi-3 (fused
checkpoints, LongRoPE
with a partial rotary factor), Gemma 3; and the sparse-MoE block's grouped CPU
path."""
import random

import pytest
import torch
import torch.nn.functional as F

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models import moe
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.registry import architectures
from tests.unit.engine.tiny_hf import tiny_checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("tiny_hf"))


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(10, 700) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _check(path, hf_reference, prompts, n=8, **engine_kw):
    engine_kw.setdefault("cache", {"num_blocks": 96, "block_size": 8})
    llm = LLM(path, **engine_kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_reference(path, p, n) for p in prompts]
    assert len({t for ids in got for t in ids}) > 3, "degenerate output proves little"
    return llm


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_moe_norm", "qwen2_moe", "mixtral", "phi3"])
def test_matches_transformers_greedy(tiny, hf_reference, name):
    # a small token budget: chunked prefill and mixed prefill/decode steps too
    llm = _check(tiny[name], hf_reference, _prompts(3, 3, 40, seed=5), scheduler={"max_num_batched_tokens": 24})
    assert llm.engine.model_args.architecture == architectures()[llm.engine.model_args.architecture].name


@pytest.mark.parametrize("max_model_len,lo,hi", [(128, 3, 30), (512, 130, 150)], ids=["short", "long"])
def test_phi3_longrope_matches_transformers(tiny, hf_reference, max_model_len, lo, hi):
    """Short factors while the served context fits original_max_position_embeddings (exact for every
    sequence), long ones beyond (exact for sequences past it, which is where transformers switches)."""
    _check(tiny["phi3_longrope"], hf_reference, _prompts(2, lo, hi, seed=9), n=6, max_model_len=max_model_len)


def test_gemma3_matches_transformers(tiny, hf_reference):
    """Local and global RoPE, query_pre_attn_scalar, tied embeddings; the full context is served (sliding
    windows past their length: tests/unit/engine/test_sliding_window.py)."""
    llm = _check(tiny["gemma3"], hf_reference, _prompts(3, 3, 50, seed=4), n=10,
                 scheduler={"max_num_batched_tokens": 24})
    assert llm.engine.max_model_len == 512
    args = llm.engine.model_args
    assert args.sliding_layers == (0, 2) and args.local_rope.theta == 10000.0 and args.rope.rope_type == "linear"
    assert llm.engine.runner.model.fused is False                        # Gemma's norm: torch ops


def test_gemma3_hub_config_shape_parses():
    """The hub's Gemma 3 1B config.json (pre-transformers-5 spelling)."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 1152,
           "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
           "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
           "final_logit_softcapping": None, "attn_logit_softcapping": None, "eos_token_id": [1, 106]}
    args = ModelArgs.from_dict(cfg)
    assert [i for i in range(26) if i not in args.sliding_layers] == [5, 11, 17, 23]
    assert (args.rope.theta, args.local_rope.theta, args.attn_scale) == (1e6, 1e4, 256 ** -0.5)
    assert args.sliding_window == 512 and args.eos_token_ids == (1, 106)
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        ModelArgs.from_dict({**cfg, "attn_logit_softcapping": 50.0})


def test_moe_layers_follow_the_config(tiny):
    args = ModelArgs.from_dir(tiny["qwen3_moe"])
    assert args.qk_norm and args.moe.layers == (0,) and not args.moe.renormalize and args.moe.num_experts == 8
    q2 = ModelArgs.from_dir(tiny["qwen2_moe"])
    assert q2.moe.shared_intermediate_size == 48 and q2.qkv_bias and not q2.o_bias and q2.moe.layers == (0, 1)
    mix = ModelArgs.from_dir(tiny["mixtral"])
    assert mix.moe.renormalize and mix.moe.layers == (0, 1) and not mix.qk_norm


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ModelLoadError) as e:
        ModelArgs.from_dict({"architectures": ["FalconForCausalLM"]})
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert name in str(e.value)


def _naive_moe(x, w13, w2, ids, weights):
    """One token at a time (the reference the grouped path must equal)."""
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += (w2[e] @ (F.silu(h[:inter]) * h[inter:])) * weights[t, j]
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_token_loop_with_one_gemm_pair_per_active_expert(monkeypatch, renormalize):
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 9, 16, 24, 6, 2
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 5] = -1e4                                     # expert 5 never chosen: no GEMM for it
    weights, ids = moe.route(logits, k, renormalize)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(t))
    else:
        assert (weights.sum(-1) < 1).all()
    calls = []
    linear = F.linear
    monkeypatch.setattr(moe.F, "linear", lambda a, w: calls.append(a.shape[0]) or linear(a, w))
    got = moe.grouped_experts(x, w13, w2, ids, weights)
    assert calls == []                  # 5 of 6 experts have tokens: all of them in two batched GEMMs
    torch.testing.assert_close(got, _naive_moe(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-4)
    # the form for few tokens: one GEMM pair per active expert, each on its rows only
    flat = torch.sort(ids, dim=1)[0].reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    looped = moe._looped_experts(x, w13, w2, flat, counts.tolist(), k)
    active = len(set(ids.flatten().tolist()))
    assert len(calls) == 2 * active and sum(calls) == 2 * t * k
    torch.testing.assert_close(looped, moe._padded_experts(x, w13, w2, flat, counts, int(counts.max()), k),
                               rtol=1e-5, atol=1e-5)


def test_moe_checkpoint_and_config_that_disagree_fail_the_preflight_in_one_line(tiny, tmp_path):
    import json
    import shutil

    from affinity_serve.engine.models.checkpoint import validate_checkpoint
    for change, expect in [({"num_local_experts": 3}, "expert 3, but config.json says 3 experts"),
                           ({"num_local_experts": 5}, "shape mismatch for model.layers.0.block_sparse_moe.gate.weight: "
                                                      "checkpoint (4, 64) vs model (5, 64)"),
                           ({"intermediate_size": 96},
                            "shape mismatch for model.layers.0.block_sparse_moe.experts.0.w")]:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(tiny["mixtral"], d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError) as e:
            validate_checkpoint(d)
        assert expect in str(e.value) and "\n" not in str(e.value)
