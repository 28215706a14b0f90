"""The engine on CUDA (issue 12, part 1): float32 greedy token-identical to transformers, and bfloat16 /
float16 within the stated tolerances of float32 transformers (tests/common/precision.py: top-1 agreement and
logprob difference, teacher-forced), each on one mixed batch with chunked prefill, prefix hits, cascade
decode and preemption, for the torch and the Triton attention backends. Skipped cleanly without CUDA."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = ["torch", "triton"]
CACHE = {"num_blocks": 36, "block_size": 16}          # small enough to preempt in this scenario
SCHED = {"max_num_batched_tokens": 64}                # chunks the 300-token prompt


def _llm(path, backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    from affinity_serve.engine import LLM
    llm = LLM(path, device="cuda", dtype=dtype, attention_backend=backend, cache=CACHE, scheduler=SCHED)
    assert llm.engine.runner.backend.name == backend
    return llm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_float32_is_token_identical_to_transformers(checkpoints, hf_reference, name, backend):
    from affinity_serve.engine import SamplingParams
    from tests.common.precision import scenario_prompts

    path = checkpoints[name]
    prompts = scenario_prompts()
    llm = _llm(path, backend, "float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.last_stats
    assert stats.prefix_cache_hits_total > 0 and stats.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(path, p, 24) for p in prompts]
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_within_tolerance_of_float32_transformers(checkpoints, hf_reference, dtype, backend):
    from tests.common.precision import agreement, scenario_prompts

    path = checkpoints["llama"]
    llm = _llm(path, backend, dtype)
    got = agreement(llm, hf_reference.logits, path, scenario_prompts())
    print(f"{backend} {dtype}: {got}")                 # the measured figures, for docs/engine.md
    got.check()
