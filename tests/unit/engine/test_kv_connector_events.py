"""The KV event contract with a tier: pool events keep medium "pool"; the offload tier reports its own
stores and evictions; replaying pool + tier events gives exactly the pool's and the tier's hashes."""
from __future__ import annotations

import asyncio
import random

from affinity_serve.engine import AsyncLLMEngine, SamplingParams
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.types import AllBlocksCleared, BlockRemoved, BlockStored


def _replay(events):
    held: dict[str, set] = {"pool": set(), "offload": set()}
    for e in events:
        if isinstance(e, BlockStored):
            held[e.medium].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held[e.medium].difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            held["pool"].clear()
    return held


def test_async_engine_feed_and_snapshot_name_the_medium(checkpoints):
    cfg = EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 16, "block_size": 8,
                                                          "enable_kv_cache_events": True},
                       kv_connector={"type": "offload", "capacity_blocks": 12})
    rng = random.Random(3)

    async def run():
        eng = AsyncLLMEngine.from_config(cfg, step_in_thread=False)
        for i in range(6):
            prompt = [rng.randrange(10, 700) for _ in range(rng.randint(30, 60))]
            async for _ in eng.generate(eng.make_request(prompt, SamplingParams(max_tokens=3, temperature=0.0),
                                                         req_id=f"r{i}")):
                pass
        while eng.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        snap = await eng.kv_snapshot()
        reply = eng.kv_events_since(0)
        await eng.shutdown()
        return snap, reply

    snap, reply = asyncio.run(run())
    held = _replay(reply.events)
    assert {e.medium for e in reply.events if not isinstance(e, AllBlocksCleared)} == {"pool", "offload"}
    assert held["pool"] == set(snap.block_hashes)
    assert held["offload"] == set(snap.tier_block_hashes["offload"]) and held["offload"]
    assert len(held["offload"]) <= 12
    assert any(isinstance(e, BlockRemoved) and e.medium == "offload" for e in reply.events), \
        "the tier was meant to fill and evict"
