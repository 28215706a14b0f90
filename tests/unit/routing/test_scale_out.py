"""Scale-out and scale-in as the router sees them: a joining replica with an empty cache gets new groups and
spill-over, not warm affinity traffic; warming it with the hottest prefixes (HotPrefixes: demand from the
routed requests, tokens from BlockStored events) makes it an affinity target with cache hits; a replica
that leaves (Serve drops a stopping replica from the set) stops being a candidate and loses its entries."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, KVSnapshot, PrefixAffinityRouterCore, Reason,
                                        ReplicaInfo, ReplicaLoadView, RouteRequest)
from affinity_serve.app.routing.warmup import HotPrefixes
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.types import BlockRemoved, BlockStored

from .helpers import Clock

BS = 4
SYSTEM = list(range(100, 164))                  # a 64-token shared prefix: 16 blocks


def _tokens(suffix_seed: int, prefix=SYSTEM, n_suffix: int = 12) -> list[int]:
    rng = random.Random(suffix_seed)
    return list(prefix) + [rng.randrange(1000, 2000) for _ in range(n_suffix)]


def _request(rid: str, ids: list[int]) -> RouteRequest:
    return RouteRequest(rid, hash_block_chain(ids, BS), len(ids), 8)


def _stored(ids: list[int], start_block: int = 0) -> BlockStored:
    """The BlockStored an engine emits after prefilling `ids` (blocks from start_block on are new)."""
    hashes = hash_block_chain(ids, BS)
    return BlockStored(hashes[start_block:], hashes[start_block - 1] if start_block else None,
                       ids[start_block * BS:len(hashes) * BS], BS)


def _core(replicas=("a", "b")) -> tuple[PrefixAffinityRouterCore, Clock]:
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(calibrate=False), BS, clock=clock, rng=random.Random(0))
    core.set_replicas([ReplicaInfo(r) for r in replicas])
    for r in replicas:
        assert core.on_kv_events(KVEventBatch(r, "e0", 0, []))
    return core, clock


def _warm_fleet():
    """a holds the system prompt (and serves its traffic), b another one; both moderately busy."""
    core, clock = _core()
    core.on_kv_events(KVEventBatch("a", "e0", 0, [_stored(_tokens(1))]))
    core.on_kv_events(KVEventBatch("b", "e0", 0, [_stored(_tokens(2, prefix=range(500, 564)))]))
    for r in "ab":
        core.on_stats(r, ReplicaLoadView(num_running=4, num_queued_prefill_tokens=300, kv_cache_usage=0.5,
                                         num_blocks=256))
    return core, clock


def _join(core: PrefixAffinityRouterCore, rid: str = "n") -> None:
    core.set_replicas([ReplicaInfo(r) for r in core.loads._loads] + [ReplicaInfo(rid)])   # noqa: SLF001
    core.on_snapshot(KVSnapshot(rid, "e0", 0, []))
    core.on_stats(rid, ReplicaLoadView(num_blocks=256))


# ---------------------------------------------------------------- the policy with a cold replica
def test_a_joining_empty_replica_does_not_take_warm_affinity_traffic():
    core, _ = _warm_fleet()
    _join(core)
    for i in range(5):
        d = core.route(_request(f"r{i}", _tokens(10 + i)), ["a", "b", "n"])
        assert (d.chosen, d.reason) == ("a", Reason.AFFINITY), d
        core.on_finished(d.req_id)
        # the empty replica is faster for this request by the prefix's prefill, but not by the release slack
        assert d.score_of("n").predicted_ttft_s < d.score_of("a").predicted_ttft_s


def test_a_joining_empty_replica_gets_new_groups_first():
    core, _ = _warm_fleet()
    _join(core)
    d = core.route(_request("new", _tokens(3, prefix=range(800, 864))), ["a", "b", "n"])
    assert (d.chosen, d.reason) == ("n", Reason.NEW_GROUP)


def test_a_joining_empty_replica_gets_the_spill_over_of_an_overloaded_one():
    core, _ = _warm_fleet()
    _join(core)
    core.on_stats("a", ReplicaLoadView(num_running=20, num_queued_prefill_tokens=20_000, kv_cache_usage=0.5,
                                       num_blocks=256))
    d = core.route(_request("r", _tokens(11)), ["a", "b", "n"])
    assert (d.chosen, d.reason) == ("n", Reason.RELEASED)
    assert d.score_of("n").predicted_cached_tokens == 0          # a cold prefill there


def test_a_warmed_replica_takes_affinity_traffic_with_cache_hits():
    core, _ = _warm_fleet()
    for i in range(4):                                          # the system prompt is hot on this router
        core.on_finished(core.route(_request(f"h{i}", _tokens(20 + i)), ["a", "b"]).req_id)
    _join(core)
    prompts = core.hot_prefixes(8)
    assert prompts[0] == SYSTEM                                 # the shared part, rebuilt from a's events
    # n prefills it (LLMReplica.warm) and reports the blocks like any other
    core.on_kv_events(KVEventBatch("n", "e0", 0, [_stored(prompts[0])]))
    core.on_stats("a", ReplicaLoadView(num_running=8, num_queued_prefill_tokens=1_000, kv_cache_usage=0.5,
                                       num_blocks=256))
    d = core.route(_request("r", _tokens(30)), ["a", "b", "n"])
    assert d.chosen == "n" and d.reason in (Reason.AFFINITY, Reason.HOT_REPLICA)
    assert d.score_of("n").predicted_cached_tokens == len(SYSTEM)


def test_a_leaving_replica_is_no_candidate_and_loses_its_entries():
    core, _ = _warm_fleet()
    assert core.index.num_held("a") > 0
    core.set_replicas([ReplicaInfo("b")])                        # a started draining: Serve dropped it
    assert core.index.num_held("a") == 0 and "a" not in core.index.replica_ids
    assert not core.index.holds_any(hash_block_chain(SYSTEM, BS)[0])
    d = core.route(_request("r", _tokens(12)), ["b"])
    assert d.chosen == "b" and d.reason is Reason.NEW_GROUP and d.score_of("b").predicted_cached_tokens == 0


# ---------------------------------------------------------------- HotPrefixes
def _hot(**kw) -> HotPrefixes:
    return HotPrefixes(BS, group_blocks=4, **kw)


def test_hot_prefixes_are_the_shared_part_hottest_first_once_seen_twice():
    hot = _hot()
    other = list(range(300, 340))
    for t, ids in enumerate([_tokens(1), _tokens(2, prefix=other), _tokens(3), _tokens(4, prefix=other),
                             _tokens(5)]):
        hot.on_route(hash_block_chain(ids, BS), len(ids), now=float(t))
        hot.on_events([_stored(ids)])
    lonely = _tokens(6, prefix=range(700, 740))
    hot.on_route(hash_block_chain(lonely, BS), 1000, now=5.0)
    hot.on_events([_stored(lonely)])
    assert hot.hot_prefixes(5, now=5.0) == [SYSTEM, other]      # 3 requests beat 2; a single one is not hot
    assert hot.hot_prefixes(1, now=5.0) == [SYSTEM]


def test_hot_prefixes_need_the_tokens_from_the_chains_first_block_and_skip_salted_prompts():
    hot = _hot()
    ids = _tokens(1)
    for i in range(2):
        hot.on_route(hash_block_chain(_tokens(i), BS), 50, now=0.0)
    hot.on_events([_stored(ids, start_block=3)])                # blocks 0-2 were never seen stored
    assert hot.hot_prefixes(4, now=0.0) == []
    hot.on_events([_stored(ids)])
    assert hot.hot_prefixes(4, now=0.0) == [SYSTEM]
    salted = _hot()
    for i in range(2):
        salted.on_route(hash_block_chain(_tokens(i), BS, cache_salt="tenant"), 50, now=0.0)
    hashes = hash_block_chain(ids, BS, cache_salt="tenant")
    salted.on_events([BlockStored(hashes, None, ids[:len(hashes) * BS], BS), BlockRemoved(hashes[:1])])
    assert salted.hot_prefixes(4, now=0.0) == []                 # a replay without the salt would not hit


def test_hot_prefixes_stay_bounded():
    hot = _hot(max_groups=16, max_blocks=64, max_prefix_blocks=8)
    for i in range(500):
        ids = _tokens(i, prefix=range(10_000 + 50 * i, 10_000 + 50 * i + 40))
        hot.on_route(hash_block_chain(ids, BS), 100, now=i * 0.01)
        hot.on_events([_stored(ids)])
    assert hot.num_groups <= 16 and hot.num_token_blocks <= 64 and len(hot._wanted) <= 64   # noqa: SLF001


def test_a_hot_group_outlives_a_flood_of_one_off_prompts_and_each_request_evicts_at_most_one(monkeypatch):
    """Past the group bound a new group evicts one group, the coldest of the least recently routed, never a
    bulk pass over all groups in one request (that pass was in the slowest 1% of 128-replica decisions)."""
    from affinity_serve.app.routing import warmup
    hot = _hot(max_groups=16, max_blocks=8192, max_prefix_blocks=8)
    calls = []
    real = warmup.HotPrefixes._decayed
    monkeypatch.setattr(warmup.HotPrefixes, "_decayed", lambda self, g, now: (calls.append(1), real(self, g, now))[1])
    for i in range(400):
        if i < 3 or i % 20 == 0:               # the system prompt's group: three, then one request in 20
            ids = _tokens(i)
        else:                                  # one-off prompts, each its own group
            ids = _tokens(i, prefix=range(10_000 + 50 * i, 10_000 + 50 * i + 40))
        calls.clear()
        hot.on_route(hash_block_chain(ids, BS), 100, now=i * 0.01)
        hot.on_events([_stored(ids)])
        assert len(calls) <= warmup.EVICT_SAMPLE + 1 and hot.num_groups <= 16
    assert hot.hot_prefixes(1, now=4.0) == [SYSTEM[:8 * BS]]


# ---------------------------------------------------------------- the Serve shell warms a joining replica
def _router(monkeypatch, warmed: list, **kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from affinity_serve.app.routing import serve_router

    class FakeClient:
        def __init__(self, replica):
            self.key = replica.replica_id.unique_id

        async def warm(self, prompts):
            warmed.append((self.key, prompts))
            return {"num_prompts": len(prompts)}

    loop = asyncio.get_running_loop()               # the router loop is this test's loop
    monkeypatch.setattr(serve_router.AffinityRequestRouter, "_event_loop", property(lambda self: loop))
    r = serve_router.AffinityRequestRouter(deployment_id=DeploymentID(name="LLMReplica", app_name="t"),
                                           handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1")
    r.initialize_state({"policy": "prefix_affinity", **kwargs}, BS)
    # On the instance, not the module: once Serve has run in this process (the integration tests), the
    # router class's functions can resolve module globals other than `serve_router`'s attribute dict.
    r.method_client = FakeClient
    return r


def _replica(key: str):
    from ray.serve._private.common import DeploymentID, ReplicaID
    return SimpleNamespace(replica_id=ReplicaID(key, DeploymentID(name="LLMReplica", app_name="t")),
                           node_id="node-1", routing_stats={}, _actor_handle=None)


async def test_the_router_warms_only_a_replica_that_joins_with_its_hottest_prefixes(monkeypatch):
    warmed: list = []
    router = _router(monkeypatch, warmed, warmup_on_join=True, warmup_num_prefixes=2)
    a = _replica("a")
    router._sync_members([a])                                  # the first view: nothing joined
    for i in range(3):
        req = _request(f"r{i}", _tokens(i))
        router.core.on_finished(router.core.route(req, ["a"]).req_id)
    router.core.on_kv_events(KVEventBatch("a", "e0", 0, [_stored(_tokens(0))]))
    router._sync_members([a, _replica("n")])
    for _ in range(500):                # the warm-up is a task of the router loop: a few loop turns
        if router.num_warmups:
            break
        await asyncio.sleep(0.01)
    assert warmed == [("n", [SYSTEM])] and router.num_warmups == 1
    router._sync_members([a, _replica("n")])                   # no change: no second warm-up
    await asyncio.sleep(0.01)
    assert len(warmed) == 1


async def test_no_warm_up_when_switched_off(monkeypatch):
    warmed: list = []
    router = _router(monkeypatch, warmed, warmup_on_join=False)
    router._sync_members([_replica("a")])
    for i in range(3):
        router.core.route(_request(f"r{i}", _tokens(i)), ["a"])
    router.core.on_kv_events(KVEventBatch("a", "e0", 0, [_stored(_tokens(0))]))
    router._sync_members([_replica("a"), _replica("n")])
    await asyncio.sleep(0.01)
    assert warmed == []
