"""LLMReplica.warm: prefilling a joining replica's hottest prefixes caches them, and a later request that
shares one finds it cached (what the router's warm-up on join relies on)."""
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.engine import SamplingParams
from affinity_serve.engine import EngineConfig


async def test_warm_caches_the_prefixes_and_skips_prompts_the_engine_refuses(checkpoints):
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    prefix = list(range(10, 42))                                   # 8 full blocks
    out = await rep.warm([prefix, list(range(5, 9)), [7] * 10_000])
    assert out["num_prompts"] == 2 and out["num_tokens"] == len(prefix) + 4
    chunks = [c async for c in rep.generate(GenerateRequest("r1", prefix + [50, 51, 52],
                                                            SamplingParams(max_tokens=2, ignore_eos=True)))]
    assert max(c.num_cached_tokens for c in chunks) == len(prefix)
    load = rep.engine.load()
    assert load.num_requests == 0 and load.num_free_blocks == load.num_blocks - 1     # nothing left held
    await rep.engine.shutdown()


async def test_a_warm_up_is_not_load_for_the_autoscaler_but_delays_requests_for_the_router(checkpoints):
    """While only warm-up prompts are in the engine (6 x 96 tokens at 16 tokens a step), the autoscaler's
    signals read an idle replica and the routing stats the warm-up's backlog; after it, both read idle."""
    import asyncio

    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.autoscale.signals import ReplicaSignals
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 256, "block_size": 4},
                                  scheduler={"max_num_batched_tokens": 16}))
    task = asyncio.create_task(rep.warm([[11 + i] + list(range(20, 115)) for i in range(6)]))
    routed, scaled = [], []
    while not task.done():
        routed.append(rep.record_routing_stats()["num_queued_prefill_tokens"])
        scaled.append(ReplicaSignals.from_metrics(rep.record_autoscaling_stats()))
        await asyncio.sleep(0.002)
    assert (await task)["num_prompts"] == 6
    assert max(routed) > 0, routed                                  # the warm-up was seen queued
    assert all(s.num_queued_prefill_tokens == 0 and s.num_running == 0 and s.num_waiting == 0
               and s.num_in_flight == 0 for s in scaled), scaled
    after = ReplicaSignals.from_metrics(rep.record_autoscaling_stats())
    assert (after.num_queued_prefill_tokens, after.num_running, after.num_recent_requests) == (0, 0, 0)
    await rep.engine.shutdown()
