import asyncio

import pytest

from affinity_serve.engine import SamplingParams
from affinity_serve.engine.async_engine import AsyncLLMEngine
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import ContextLengthExceededError, EngineDeadError, EngineError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_engine(checkpoints):
    def make(**kw):
        kw.setdefault("cache", {"num_blocks": 64, "block_size": 4})
        return AsyncLLMEngine.from_config(EngineConfig(model=checkpoints["llama"], max_model_len=256, **kw))

    return make


def _all_free(eng):
    pool = eng.engine.kv_cache_manager.pool
    return pool.num_free_blocks == pool.num_blocks - 1 and not eng.engine.scheduler.requests


async def _collect(gen):
    deltas = []
    async for d in gen:
        deltas.append(d)
    return deltas


async def test_streams_match_offline_and_run_concurrently(make_engine, hf_reference, checkpoints):
    eng = make_engine()
    prompts = [[10, 20, 30, 40, 50], [7, 8, 9], list(range(100, 140))]
    results = await asyncio.gather(*[
        _collect(eng.generate(eng.make_request(p, SamplingParams(max_tokens=9, **GREEDY), req_id=f"r{i}")))
        for i, p in enumerate(prompts)])
    for p, deltas in zip(prompts, results):
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert sum((d.token_ids for d in deltas), []) == hf_reference(checkpoints["llama"], p, 9)
        assert len(deltas) == 9           # one delta per step: streamed, not batched at the end
    assert _all_free(eng)
    eng.check_health()
    await eng.shutdown()


async def test_cancelling_consumer_aborts_and_frees_within_a_step(make_engine):
    eng = make_engine()
    gen = eng.generate(eng.make_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=200, **GREEDY), req_id="long"))
    got = 0
    async for _ in gen:
        got += 1
        if got == 3:
            break
    await gen.aclose()
    steps = eng.num_steps
    for _ in range(200):
        if _all_free(eng):
            break
        await asyncio.sleep(0.005)
    assert _all_free(eng)
    assert eng.num_steps <= steps + 1
    # and the engine keeps serving
    deltas = await _collect(eng.generate(eng.make_request([3, 4], SamplingParams(max_tokens=3, **GREEDY))))
    assert deltas[-1].finished
    await eng.shutdown()


async def test_task_cancellation_aborts(make_engine):
    eng = make_engine()

    received = []

    async def consume():
        async for d in eng.generate(eng.make_request([9] * 10, SamplingParams(max_tokens=200, **GREEDY), req_id="c")):
            received.append(d)

    task = asyncio.create_task(consume())
    for _ in range(2000):
        if eng.num_steps >= 3:
            break
        await asyncio.sleep(0.005)
    assert eng.num_steps >= 3 and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert received and not received[-1].finished
    for _ in range(200):
        if _all_free(eng):
            break
        await asyncio.sleep(0.005)
    assert _all_free(eng)
    await eng.shutdown()


async def test_bad_input_raises_before_queueing(make_engine):
    eng = make_engine()
    with pytest.raises(ContextLengthExceededError) as e:
        await _collect(eng.generate(eng.make_request([1] * 300, SamplingParams(max_tokens=5))))
    assert e.value.param == "prompt" and "context length" in str(e.value)
    assert eng.num_in_flight == 0 and _all_free(eng)
    await eng.shutdown()


async def test_step_failure_fails_affected_requests_then_recovers_then_dies(make_engine, monkeypatch):
    eng = make_engine()
    runner = eng.engine.runner
    real = runner.execute_model
    failures = {"left": 1}

    def flaky(so):
        if failures["left"] and so.num_scheduled_tokens:
            failures["left"] -= 1
            raise RuntimeError("boom")
        return real(so)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(EngineError, match="boom"):
        await asyncio.wait_for(
            _collect(eng.generate(eng.make_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY)))), 10)
    assert _all_free(eng)
    ok = await asyncio.wait_for(
        _collect(eng.generate(eng.make_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY)))), 10)
    assert ok[-1].finished
    eng.check_health()
    failures["left"] = 10**6         # now every step fails: after a few the engine declares itself dead
    for _ in range(3):
        with pytest.raises(EngineError):
            await asyncio.wait_for(
                _collect(eng.generate(eng.make_request([4, 5], SamplingParams(max_tokens=4, **GREEDY)))), 10)
    with pytest.raises(EngineDeadError):
        eng.check_health()
    with pytest.raises(EngineDeadError):
        await _collect(eng.generate(eng.make_request([4, 5], SamplingParams(max_tokens=4))))
    await eng.shutdown()


async def test_n_sequences_stream_with_indices(make_engine):
    eng = make_engine()
    deltas = await _collect(eng.generate(eng.make_request([5, 6, 7], SamplingParams(n=2, max_tokens=3, temperature=1.0,
                                                                                    seed=1, ignore_eos=True))))
    assert {d.index for d in deltas} == {0, 1}
    assert sum(d.finished for d in deltas) == 2
    assert _all_free(eng)
    await eng.shutdown()


async def test_background_requests_are_counted_apart_in_the_load(make_engine):
    """A background request (a cache warm-up) runs like any other and is also counted apart: while it
    prefills at 16 tokens a step, the load's totals minus its background part are exactly the normal request
    queued behind it (96 tokens, waiting); afterwards nothing is left in either."""
    eng = make_engine(cache={"num_blocks": 128, "block_size": 4}, scheduler={"max_num_batched_tokens": 16})
    bg = asyncio.ensure_future(_collect(eng.generate(eng.make_request([3] + list(range(200, 295)),
                                                                      SamplingParams(max_tokens=1),
                                                                      background=True, req_id="warm"))))
    await asyncio.sleep(0)                              # queued first: FCFS gives it the budget
    normal = asyncio.ensure_future(_collect(eng.generate(eng.make_request(list(range(300, 396)),
                                                                          SamplingParams(max_tokens=2),
                                                                          req_id="real"))))
    seen = []
    while not normal.done():
        load = eng.load()
        assert 0 <= load.num_background_queued_prefill_tokens <= load.num_queued_prefill_tokens
        assert load.num_background_running <= load.num_running_reqs
        assert load.num_background_waiting <= load.num_waiting_reqs
        assert eng.num_background_in_flight == (0 if bg.done() else 1)
        if load.num_background_running == 1 and load.num_waiting_reqs == 1:       # "real" waits behind it
            seen.append(load.num_queued_prefill_tokens - load.num_background_queued_prefill_tokens)
            assert load.num_background_queued_prefill_tokens > 0
        await asyncio.sleep(0.001)
    await bg
    assert seen and set(seen) == {96}, seen
    load = eng.load()
    assert (load.num_background_running, load.num_background_waiting, load.num_background_queued_prefill_tokens,
            eng.num_background_in_flight) == (0, 0, 0, 0)
    await eng.shutdown()
