"""Engine step edge cases on a tiny model: a failed step, and schedule() running ahead of the model."""
import pytest

from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.llm_engine import LLMEngine, StepError
from affinity_serve.engine.sampling_params import SamplingParams


def test_failed_step_finishes_unscheduled_siblings(checkpoints, monkeypatch):
    # max_num_seqs=1: the step schedules sibling #0 only, sibling #1 is still waiting when it fails
    eng = LLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4},
                                 scheduler={"max_num_seqs": 1}))
    real = eng.runner.execute_model
    failures = {"left": 1}

    def flaky(so):
        if failures["left"] and so.num_scheduled_tokens:
            failures["left"] -= 1
            raise RuntimeError("boom")
        return real(so)

    monkeypatch.setattr(eng.runner, "execute_model", flaky)
    eng.add_request(eng.make_request([5, 6, 7, 8, 9], SamplingParams(n=2, max_tokens=50, temperature=1.0, seed=1,
                                                        ignore_eos=True), req_id="a"))
    with pytest.raises(StepError) as e:
        eng.step()
    assert e.value.req_ids == {"a"}
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.has_unfinished_requests()
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    # the engine keeps serving: a later request runs to completion and nothing of "a" comes back
    eng.add_request(eng.make_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                     req_id="b"))
    seen = set()
    while eng.has_unfinished_requests():
        seen |= {d.req_id for d in eng.step().deltas}
    assert seen == {"b"}
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_schedule_ahead_with_preemption_keeps_runner_and_scheduler_in_step(checkpoints, hf_reference):
    """schedule() twice before the first output arrives, preempting a request whose token is in flight."""
    path = checkpoints["llama"]
    eng = LLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 5, "block_size": 4},    # 4 usable blocks
                                 scheduler={"long_prefill_token_threshold": 4}))
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = {"c": [30 + i for i in range(12)], "a": [10, 11, 12, 13]}
    eng.add_request(eng.make_request(prompts["c"], SamplingParams(max_tokens=1, **greedy), req_id="c"))
    eng.add_request(eng.make_request(prompts["a"], SamplingParams(max_tokens=3, **greedy), req_id="a"))
    got = {"a": [], "c": []}

    def collect(step_output):
        for d in step_output.deltas:
            got[d.req_id] += d.token_ids

    collect(eng.step())
    sched, runner = eng.scheduler, eng.runner
    so1 = sched.schedule()                 # c: next prompt chunk, a: one decode
    so2 = sched.schedule()                 # c needs a block: "a", with a token in flight, is preempted
    assert so2.preempted_req_ids == {"a"}
    for so in (so1, so2):
        out = sched.update_from_output(so, runner.execute_model(so))
        collect(eng._process(out.outputs, out.stats))
    while eng.has_unfinished_requests():
        collect(eng.step())
    assert got == {rid: hf_reference(path, ids, len(got[rid])) for rid, ids in prompts.items()}
    assert [len(got["a"]), len(got["c"])] == [3, 1]
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
