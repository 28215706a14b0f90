"""LLMReplica reports its KV tier's counters (issue 26): the tier's name and every KVConnectorStats field, in
`kv_tier_stats()` (for the ingress's metrics) and `debug_state()`; None without a connector."""
import dataclasses

from affinity_serve.engine import SamplingParams
from affinity_serve.engine.kv_connector import KVConnectorStats
from affinity_serve.engine import EngineConfig


async def test_the_replica_reports_its_tier_and_counters(checkpoints, tmp_path):
    from affinity_serve.app.protocol import GenerateRequest
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4},
                      kv_connector={"type": "shared", "shared_dir": str(tmp_path / "kv"), "capacity_blocks": 64}))
    prompt = list(range(10, 31))
    async for _ in rep.generate(GenerateRequest("r1", prompt, SamplingParams(max_tokens=2, ignore_eos=True))):
        pass
    stats = rep.kv_tier_stats()
    assert set(stats) == {f.name for f in dataclasses.fields(KVConnectorStats)}
    assert stats["lookups"] == 1 and stats["load_failures_damaged"] == 0
    state = await rep.debug_state()
    assert state["kv_tier"] == "shared" and set(state["kv_connector"]) == set(stats)
    await rep.engine.shutdown()
    plain = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    assert plain.kv_tier_stats() is None and (await plain.debug_state())["kv_tier"] == "none"
    await plain.engine.shutdown()
