"""The replica side of prefix-affinity routing: the KV event feed routers pull, and prompts hashed once at
the ingress (the replica's engine uses those hashes instead of hashing again)."""
import pickle

import affinity_serve.engine.request  # noqa: F401

from affinity_serve import engine
from affinity_serve.app.config import AppConfig
from affinity_serve.app.ingress import Ingress
from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
from affinity_serve.app.replica import LLMReplica
from affinity_serve.engine import EngineLimits, SamplingParams
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine import EngineConfig
from tests.unit.app.conftest import LocalHandle
from tests.unit.engine.test_kv_events import replay


async def test_replica_serves_its_kv_feed_as_plain_values_with_events_always_on(checkpoints):
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"],
                                  cache={"num_blocks": 32, "block_size": 4, "enable_kv_cache_events": False}))
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
        yield ReplicaChunk("", 0, "x", [1], "length", num_prompt_tokens=len(req.prompt_token_ids))

    class Fake:
        async def generate(self, req):
            async for c in behaviour(req):
                yield c

        async def limits(self):
            return EngineLimits(max_model_len=64, vocab_size=1000, max_kv_tokens=64, block_size=4)

    cfg = AppConfig.model_validate({"engine": {"model": "unused", "skip_tokenizer_init": True}})
    handle = LocalHandle(Fake())
    ing = Ingress(handle, cfg)
    prompts = [list(range(10, 19)), list(range(50, 53))]      # 2 full blocks; none
    await ing.completions({"prompt": prompts, "max_tokens": 1, "cache_salt": "t"})
    sent = [args[0] for name, args in handle.calls if name == "generate"]
    assert sorted(r.block_hashes for r in sent) == sorted(hash_block_chain(p, 4, "t") for p in prompts)


async def test_a_prompt_hashed_at_the_ingress_is_not_hashed_again_by_the_engine(checkpoints, monkeypatch):
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    ing = Ingress(LocalHandle(rep), AppConfig.model_validate({"engine": {"model": checkpoints["llama"]}}))
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


def test_serve_access_log_lines_of_kv_feed_pulls_are_dropped():
    """Serve's replica logs one access record per call on "ray.serve" with `serve_access_log` and the
    call's `request_id` (ray/serve/_private/replica.py): the feed's are dropped, everything else kept."""
    import logging

    from affinity_serve.app.routing.serve_compat import DropKVFeedAccessLogs, drop_kv_feed_access_logs
    from affinity_serve.app.routing.feed import KV_FEED_REQUEST_ID_PREFIX

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    serve_logger, keep = logging.getLogger("ray.serve"), Keep()
    saved = (serve_logger.level, list(serve_logger.filters))
    serve_logger.addHandler(keep)
    serve_logger.setLevel(logging.INFO)
    try:
        drop_kv_feed_access_logs()
        drop_kv_feed_access_logs()
        assert sum(isinstance(f, DropKVFeedAccessLogs) for f in serve_logger.filters) == 1
        access = {"serve_access_log": True, "skip_context_filter": True}
        serve_logger.info("CALL kv_events_since OK 0.4ms",
                          extra={**access, "request_id": f"{KV_FEED_REQUEST_ID_PREFIX}kv_events_since"})
        serve_logger.info("CALL kv_snapshot OK 2ms", extra={**access, "request_id": "kv-feed-kv_snapshot"})
        serve_logger.info("CALL generate OK 80ms", extra={**access, "request_id": "3f2a"})
        serve_logger.info("POST /v1/completions 200 90ms", extra={**access, "request_id": "kv-feed-not-access"}
                          | {"serve_access_log": False})
        serve_logger.warning("replica kv-feed-x is slow", extra={"request_id": "kv-feed-kv_snapshot"})
        assert keep.messages == ["CALL generate OK 80ms", "POST /v1/completions 200 90ms",
                                 "replica kv-feed-x is slow"]
    finally:
        serve_logger.removeHandler(keep)
        serve_logger.setLevel(saved[0])
        serve_logger.filters[:] = saved[1]
