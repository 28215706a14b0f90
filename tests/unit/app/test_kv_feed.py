"""The replica side of prefix-affinity routing: the KV event feed routers pull, and prompts hashed once at
the ingress (the replica's engine uses those hashes instead of hashing again)."""
import pickle

import engine.request
from app.config import AppConfig
from app.ingress import Ingress
from app.protocol import GenerateRequest, ReplicaChunk
from app.replica import LLMReplica
from engine import EngineLimits, SamplingParams
from engine.hashing import hash_block_chain
from tests.unit.app.conftest import LocalHandle
from tests.unit.engine.test_kv_events import replay


async def test_replica_serves_its_kv_feed_as_plain_values_with_events_always_on(checkpoints):
    rep = LLMReplica({"model": checkpoints["llama"],
                      "cache": {"num_blocks": 32, "block_size": 4, "enable_kv_cache_events": False}})
    assert (await rep.limits()).block_size == 4
    [c async for c in rep.generate(GenerateRequest("a", list(range(10, 31)), SamplingParams(max_tokens=2)))]
    epoch = rep.stats().cache_epoch
    events = pickle.loads(pickle.dumps(await rep.kv_events_since(0, epoch)))   # what crosses to a router
    snap = pickle.loads(pickle.dumps(await rep.kv_snapshot()))
    assert not events.snapshot_required and events.epoch == snap.epoch == epoch
    view: set = set()
    replay(view, events.events)
    assert view == set(snap.block_hashes) and len(view) == 5 and snap.next_seq == events.next_seq
    assert rep.stats().num_blocks == 32
    assert await rep.reset_prefix_cache()
    assert (await rep.kv_events_since(events.next_seq, epoch)).snapshot_required
    await rep.engine.shutdown()


async def test_the_ingress_sends_each_prompts_engine_hashes():
    async def behaviour(req):
        yield ReplicaChunk(0, "x", [1], "length", num_prompt_tokens=len(req.prompt_token_ids))

    class Fake:
        async def generate(self, req):
            async for c in behaviour(req):
                yield c

        async def limits(self):
            return EngineLimits(max_model_len=64, vocab_size=1000, max_kv_tokens=64, block_size=4)

    cfg = AppConfig.model_validate({"engine": {"model": "unused", "skip_tokenizer_init": True}})
    handle = LocalHandle(Fake())
    ing = Ingress(handle, cfg.model_dump())
    prompts = [list(range(10, 19)), list(range(50, 53))]      # 2 full blocks; none
    await ing.completions({"prompt": prompts, "max_tokens": 1, "cache_salt": "t"})
    sent = [args[0] for name, args in handle.calls if name == "generate"]
    assert sorted(r.block_hashes for r in sent) == sorted(hash_block_chain(p, 4, "t") for p in prompts)


async def test_a_prompt_hashed_at_the_ingress_is_not_hashed_again_by_the_engine(checkpoints, monkeypatch):
    rep = LLMReplica({"model": checkpoints["llama"], "cache": {"num_blocks": 64, "block_size": 4}})
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": {"model": checkpoints["llama"]}}).model_dump())
    calls = []
    real = engine.request.hash_block_chain
    monkeypatch.setattr(engine.request, "hash_block_chain", lambda *a, **k: calls.append(a) or real(*a, **k))
    body = {"prompt": list(range(10, 31)), "max_tokens": 2, "ignore_eos": True, "cache_salt": "t",
            "temperature": 0}
    first = await ing.completions(body)
    second = await ing.completions(body)
    assert calls == []                      # 21 + 2 tokens: no output block completes either
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    await rep.engine.shutdown()
