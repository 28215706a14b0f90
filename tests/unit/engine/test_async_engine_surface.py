"""AsyncLLMEngine's thread-safe surface: limits, and load()/health() snapshots built by the step loop."""
import asyncio
import dataclasses
import threading
import time

import pytest

from affinity_serve.engine import AsyncLLMEngine, EngineConfig, EngineLimits, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(checkpoints):
    return AsyncLLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 32,
                                                                                      "block_size": 4}))


async def _collect(gen):
    return [d async for d in gen]


async def test_limits_are_the_built_engines_own(engine):
    assert engine.limits == EngineLimits(max_model_len=124, vocab_size=engine.engine.model_args.vocab_size,
                                         max_kv_tokens=124, block_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.limits.max_model_len = 1
    await engine.shutdown()


async def test_load_is_a_snapshot_taken_between_steps(engine, monkeypatch):
    idle = engine.load()
    assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.num_requests) == (0, 0, 0)
    assert idle.num_free_blocks == idle.num_blocks - 1 == 31
    entered, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def gated_step():
        entered.set()
        release.wait(10)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", gated_step)
    task = asyncio.create_task(_collect(engine.generate(engine.make_request([5, 6, 7, 8, 9],
                                                                            SamplingParams(max_tokens=3, **GREEDY)))))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    during = engine.load()          # the step thread is inside schedule/execute: the snapshot does not move
    assert during.num_waiting_reqs == 1 and during.num_running_reqs == 0 and during.num_requests == 1
    assert engine.load() is during
    release.set()
    await asyncio.wait_for(task, 10)
    after = engine.load()
    assert after.num_requests == 0 and after.num_free_blocks == 31 and after.prefix_cache_queries_total == 5
    assert after.timestamp > during.timestamp
    await engine.shutdown()


async def test_health_recent_hit_rate_and_prefix_cache_reset(engine):
    h = engine.health()
    assert h.is_alive and h.num_unfinished_reqs == 0
    prompt = list(range(10, 30))
    for _ in range(2):
        await _collect(engine.generate(engine.make_request(prompt, SamplingParams(max_tokens=2, **GREEDY))))
    assert engine.health().num_steps >= 2
    load = engine.load()
    assert (load.recent_prefix_cache_queries, load.recent_prefix_cache_hits) == (40, 16)   # 4 full blocks hit
    epoch = load.cache_epoch
    assert await engine.reset_prefix_cache()
    load = engine.load()
    assert load.cache_epoch == f"{engine.boot_id}:1" != epoch and load.recent_prefix_cache_queries == 0
    await engine.shutdown()


async def test_an_idle_spell_does_not_count_as_a_wedged_first_step(engine, monkeypatch):
    """Progress time restarts when work arrives: a replica idle for longer than its wedge timeout must not
    look wedged while it runs the first step after the idle spell."""
    # loop started, now idle
    await _collect(engine.generate(engine.make_request([1, 2, 3], SamplingParams(max_tokens=1, **GREEDY))))
    await asyncio.sleep(0.05)
    engine.last_progress_time -= 3600            # as if idle for an hour
    entered, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def gated_step():
        entered.set()
        release.wait(10)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", gated_step)
    task = asyncio.create_task(_collect(engine.generate(engine.make_request([5, 6, 7],
                                                                            SamplingParams(max_tokens=2, **GREEDY)))))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    h = engine.health()
    assert h.num_unfinished_reqs == 1
    assert time.monotonic() - h.last_progress_time < 5      # not an hour: the idle spell is forgiven
    release.set()
    await asyncio.wait_for(task, 10)
    await engine.shutdown()


async def test_cached_prefix_blocks_block_size_and_pd_bytes_are_public(engine):
    """What the P/D decode replica reads instead of the engine's internals (app/disagg.py)."""
    from affinity_serve.engine.hashing import hash_block_chain
    prompt = list(range(1, 18))                            # 4 full blocks of 4 and one token
    hashes = hash_block_chain(prompt, 4)
    assert engine.block_size == 4 and engine.pd_block_bytes == 0       # no pd connector
    assert engine.num_cached_prefix_blocks(hashes) == 0
    await _collect(engine.generate(engine.make_request(prompt, SamplingParams(max_tokens=2, **GREEDY))))
    assert engine.num_cached_prefix_blocks(hashes) == 4
    assert engine.num_cached_prefix_blocks([b"x" * 32, *hashes]) == 0  # leading blocks only
    await engine.shutdown()
