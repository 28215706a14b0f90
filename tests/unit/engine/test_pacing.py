"""engine.pace: every step lasts at least the modelled accelerator's step time; the tokens stay the model's."""
import pytest
from pydantic import ValidationError

from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.llm_engine import LLMEngine
from affinity_serve.engine.sampling_params import SamplingParams

PACE = {"enabled": True, "step_base_s": 0.02, "prefill_per_token_s": 0.01, "decode_per_context_token_s": 0.001}


def _run(path, pace=None):
    cfg = {"model": path, "cache": {"num_blocks": 32, "block_size": 4}}
    eng = LLMEngine.from_config(EngineConfig(**cfg, **({"pace": pace} if pace else {})))
    eng.add_request(eng.make_request(list(range(5, 13)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                     req_id="a"))
    tokens, step_times = [], []
    while eng.has_unfinished_requests():
        out = eng.step()
        step_times.append(eng.last_stats.step_time_s)
        tokens += [t for d in out.deltas for t in d.token_ids]
    return eng, tokens, step_times


def test_paced_steps_last_the_modelled_time_and_keep_the_tokens(checkpoints, hf_reference):
    path = checkpoints["llama"]
    eng, tokens, step_times = _run(path, PACE)
    assert tokens == hf_reference(path, list(range(5, 13)), 3)
    _, unpaced, _ = _run(path)
    assert tokens == unpaced
    # step 1 prefills the 8 prompt tokens; steps 2 and 3 decode with 9 and 10 tokens of context
    modelled = [0.02 + 8 * 0.01, 0.02 + 9 * 0.001, 0.02 + 10 * 0.001]
    assert len(step_times) == 3
    for got, want in zip(step_times, modelled):
        assert got >= want - 1e-3, (step_times, modelled)
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_pace_off_by_default_and_needs_a_step_time(checkpoints):
    assert EngineConfig(model="m").pace.enabled is False
    with pytest.raises(ValidationError, match="pace.step_base_s"):
        EngineConfig(model="m", pace={"enabled": True})
    with pytest.raises(ValidationError):
        EngineConfig(model="m", pace={"enabled": True, "step_base_s": -1})
