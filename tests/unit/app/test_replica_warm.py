"""LLMReplica.warm: prefilling a joining replica's hottest prefixes caches them, and a later request that
shares one finds it cached (what the router's warm-up on join relies on)."""
from app.protocol import GenerateRequest
from engine import SamplingParams


async def test_warm_caches_the_prefixes_and_skips_prompts_the_engine_refuses(checkpoints):
    from app.replica import LLMReplica
    rep = LLMReplica({"model": checkpoints["llama"], "cache": {"num_blocks": 64, "block_size": 4}})
    prefix = list(range(10, 42))                                   # 8 full blocks
    out = await rep.warm([prefix, list(range(5, 9)), [7] * 10_000])
    assert out["num_prompts"] == 2 and out["num_tokens"] == len(prefix) + 4
    chunks = [c async for c in rep.generate(GenerateRequest("r1", prefix + [50, 51, 52],
                                                            SamplingParams(max_tokens=2, ignore_eos=True)))]
    assert max(c.num_cached_tokens for c in chunks) == len(prefix)
    load = rep.engine.load()
    assert load.num_requests == 0 and load.num_free_blocks == load.num_blocks - 1     # nothing left held
    await rep.engine.shutdown()
