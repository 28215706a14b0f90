"""bfloat16 on CPU against transformers in float32, within the stated tolerances (tests/common/precision.py):
top-1 agreement and logprob difference over a mixed batch with chunked prefill, prefix hits, cascade decode
and preemption. tests/gpu/test_cuda_correctness.py applies the same measure on CUDA."""
from __future__ import annotations

from affinity_serve.engine import LLM
from tests.common.precision import agreement, scenario_prompts


def test_bfloat16_engine_stays_within_tolerance_of_float32_transformers(checkpoints, hf_reference):
    path = checkpoints["llama"]
    llm = LLM(path, dtype="bfloat16", cache={"num_blocks": 36, "block_size": 16},
              scheduler={"max_num_batched_tokens": 64})
    got = agreement(llm, hf_reference.logits, path, scenario_prompts())
    stats = llm.engine.last_stats
    assert stats.prefix_cache_hits_total > 0 and stats.num_preemptions_total > 0
    got.check()
