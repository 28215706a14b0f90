"""AsyncLLMEngine's KV event feed and snapshots (what routers pull), and prompts that bring their hashes."""
import asyncio
import threading

import pytest

import affinity_serve.engine.request  # noqa: F401

from affinity_serve import engine
from affinity_serve.engine import AsyncLLMEngine, EngineConfig, SamplingParams
from affinity_serve.engine.errors import EngineError
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.types import AllBlocksCleared

from tests.unit.engine.test_kv_events import replay

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_engine(checkpoints):
    def make(events=True, **cache):
        return AsyncLLMEngine.from_config(EngineConfig(model=checkpoints["llama"], max_model_len=128, cache={
            "num_blocks": 24, "block_size": 4, "enable_kv_cache_events": events, **cache}))

    return make


async def _run(eng, prompt, max_tokens=3, **kw):
    return [d async for d in eng.generate(eng.make_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY),
                                                           **kw))]


async def test_events_and_snapshots_mirror_the_cache(make_engine):
    eng = make_engine()
    first = await eng.kv_snapshot()
    assert first.block_hashes == [] and first.next_seq == 0 and first.epoch == eng.load().cache_epoch
    view: set = set()
    seq = 0
    for i in range(8):          # 8 x 5 blocks into 23: evictions
        await _run(eng, [100 + i] * 20 + [7])
        r = eng.kv_events_since(seq, first.epoch)
        assert not r.snapshot_required and r.first_seq == seq and r.epoch == first.epoch
        replay(view, r.events)
        seq = r.next_seq
        snap = await eng.kv_snapshot()
        assert snap.next_seq == seq and set(snap.block_hashes) == view
    assert view == set(eng.engine.kv_cache_manager.pool.cached)
    await eng.shutdown()


async def test_snapshot_waits_for_the_running_step(make_engine, monkeypatch):
    eng = make_engine()
    entered, release = threading.Event(), threading.Event()
    real_step = eng.engine.step

    def gated_step():
        entered.set()
        release.wait(10)
        return real_step()

    monkeypatch.setattr(eng.engine, "step", gated_step)
    run = asyncio.create_task(_run(eng, list(range(10, 30)), max_tokens=1))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    snap = asyncio.create_task(eng.kv_snapshot())
    await asyncio.sleep(0.05)
    assert not snap.done()                       # the step thread is mid-step: no reading the pool now
    release.set()
    await asyncio.wait_for(run, 10)
    s = await asyncio.wait_for(snap, 10)
    assert len(s.block_hashes) == 5 and s.next_seq == 1     # the prompt's 5 blocks, one BlockStored
    await eng.shutdown()


async def test_a_reset_starts_a_new_epoch_that_opens_with_all_blocks_cleared(make_engine):
    eng = make_engine()
    await _run(eng, list(range(10, 30)))
    old = await eng.kv_snapshot()
    assert await eng.reset_prefix_cache()
    new_epoch = eng.load().cache_epoch
    assert new_epoch != old.epoch and new_epoch.split(":")[0] == old.epoch.split(":")[0] == eng.boot_id
    r = eng.kv_events_since(old.next_seq, old.epoch)
    assert r.snapshot_required and r.events == [] and r.epoch == new_epoch
    r = eng.kv_events_since(old.next_seq, new_epoch)
    assert r.events == [AllBlocksCleared()] and r.first_seq == old.next_seq
    snap = await eng.kv_snapshot()
    assert (snap.epoch, snap.next_seq, snap.block_hashes) == (new_epoch, old.next_seq + 1, [])
    await eng.shutdown()


async def test_events_off_means_no_feed_but_snapshots_still_work(make_engine):
    eng = make_engine(events=False)
    await _run(eng, list(range(10, 30)))
    with pytest.raises(EngineError, match="enable_kv_cache_events"):
        eng.kv_events_since(0)
    assert len((await eng.kv_snapshot()).block_hashes) == 5
    await eng.shutdown()


async def test_a_small_event_buffer_makes_a_lagging_reader_resync(make_engine):
    eng = make_engine(kv_event_buffer_blocks=6)
    for i in range(3):
        await _run(eng, [200 + i] * 20 + [7])
    assert eng.kv_events_since(0).snapshot_required
    snap = await eng.kv_snapshot()
    assert not eng.kv_events_since(snap.next_seq, snap.epoch).snapshot_required
    await eng.shutdown()


# ---------------------------------------------------------------- hashes computed once, at the ingress
async def test_a_request_that_brings_its_hashes_is_not_hashed_again(make_engine, monkeypatch):
    eng = make_engine()
    prompt = list(range(10, 30))             # 5 full blocks; 2 output tokens complete no new block
    hashes = hash_block_chain(prompt, 4, "tenant")
    calls = []
    real = engine.request.hash_block_chain
    monkeypatch.setattr(engine.request, "hash_block_chain", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = await _run(eng, prompt, max_tokens=2, cache_salt="tenant", block_hashes=hashes)
    assert calls == [] and out[-1].finished
    assert set(eng.engine.kv_cache_manager.pool.cached) == set(hashes)
    await _run(eng, prompt, max_tokens=2, cache_salt="tenant")       # no hashes brought: hashed here
    assert len(calls) == 1
    await eng.shutdown()


@pytest.mark.parametrize("wrong", ["too_few", "other_block_size", "other_salt", "garbage_last", "not_bytes"])
async def test_wrong_hashes_are_recomputed(make_engine, wrong):
    prompt = list(range(10, 31))             # 5 full blocks + 1 token
    right = hash_block_chain(prompt, 4, "t")
    bad = {"too_few": right[:4], "other_block_size": hash_block_chain(prompt, 2, "t")[:5],
           "other_salt": hash_block_chain(prompt, 4, "u"), "garbage_last": right[:4] + [b"\0" * 32],
           "not_bytes": [h.hex() for h in right]}[wrong]
    ref, eng = make_engine(), make_engine()
    expected = await _run(ref, prompt, max_tokens=4, cache_salt="t")
    got = await _run(eng, prompt, max_tokens=4, cache_salt="t", block_hashes=bad)
    assert [d.token_ids for d in got] == [d.token_ids for d in expected]
    again = await _run(eng, prompt, max_tokens=4, cache_salt="t", block_hashes=right)
    assert again[0].num_cached_tokens == 20 and [d.token_ids for d in again] == [d.token_ids for d in expected]
    await ref.shutdown()
    await eng.shutdown()
