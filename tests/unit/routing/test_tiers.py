"""The router knows the KV tiers: pool hits are free, offload-tier and node-shared-store hits cost their load.

Hand-built KV events with the engine's `medium` ("pool", "offload", "shared"), as engine/kv_connector emits
them; replicas a, b on node n1 and c on node n2 unless a test says otherwise.
"""
from __future__ import annotations

import random

import pytest

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, KVSnapshot, PrefixAffinityRouterCore, Reason,
                                        ReplicaInfo, ReplicaLoadView, RouteRequest)
from affinity_serve.app.routing.debug import decision_to_dict, routing_record
from affinity_serve.app.routing.load import ReplicaLoad, TTFTModel
from affinity_serve.app.routing.prefix_index import PrefixIndex
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.types import (MEDIUM_OFFLOAD, MEDIUM_SHARED, AllBlocksCleared, BlockRemoved, BlockStored,
                          KVCacheSnapshot)

from .helpers import BS, Clock, chain

RATE = 10_000.0              # prefill prior, tokens/s
LOAD_RATE = 100_000.0        # tier load prior, tokens/s
PREFIX = chain("sys", 64)    # 1024 tokens


def stored(hashes, medium="pool"):
    return BlockStored(list(hashes), None, [], BS, medium=medium)


def removed(hashes, medium="pool"):
    return BlockRemoved(list(hashes), medium=medium)


def make(replicas=(("a", "n1"), ("b", "n1"), ("c", "n2")), **cfg):
    cfg.setdefault("calibrate", False)
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(prefill_tokens_per_s=RATE, tier_load_tokens_per_s=LOAD_RATE,
                                                   **cfg), BS, clock=clock, rng=random.Random(0))
    core.set_replicas([ReplicaInfo(r, n) for r, n in replicas])
    for r, _ in replicas:
        assert core.on_kv_events(KVEventBatch(r, "e0", 0, []))
    return core, clock


class Feed:
    """Per-replica event numbering, as each engine numbers its own stream."""

    def __init__(self, core):
        self.core, self.seq = core, {}

    def send(self, rid, *events):
        seq = self.seq.get(rid, 0)
        ok = self.core.on_kv_events(KVEventBatch(rid, "e0", seq, list(events)))
        self.seq[rid] = seq + len(events)
        return ok


def req(rid, prefix=PREFIX, extra_blocks=6, max_tokens=0):
    hashes = list(prefix) + chain(rid, extra_blocks)
    return RouteRequest(rid, hashes, len(hashes) * BS + 4, max_tokens)


# ---------------------------------------------------------------- the index
def test_shared_store_blocks_are_loadable_by_every_replica_of_the_node_and_no_other():
    ix = PrefixIndex(1000, 10.0)
    for rid, node in (("a", "n1"), ("b", "n1"), ("c", "n2")):
        ix.add_replica(rid, node)
        assert ix.apply_events(KVEventBatch(rid, "e0", 0, []))
    p = chain("p", 8)
    ix.apply_events(KVEventBatch("a", "e0", 0, [stored(p[:5]), stored(p[:5], MEDIUM_SHARED)]))
    pool = ix.match(p, ["a", "b", "c"])
    assert pool == {"a": 5}
    # a's pool ends at block 5 and the store holds nothing more; b (same node) can load all 5; c nothing
    assert ix.match_tiers(p, ["a", "b", "c"], pool) == {"b": 5}
    # another replica of n1 computes blocks 5-7 into the store: a continues its pool hit with a load
    ix.apply_events(KVEventBatch("b", "e0", 0, [stored(p[5:], MEDIUM_SHARED)]))
    assert ix.match_tiers(p, ["a", "b", "c"], pool) == {"a": 3, "b": 8}
    # an eviction reported by any replica of the node removes the block for all of them
    ix.apply_events(KVEventBatch("b", "e0", 1, [removed(p[6:7], MEDIUM_SHARED)]))
    assert ix.match_tiers(p, ["a", "b", "c"], pool) == {"a": 1, "b": 6}
    assert ix.num_tier_held("c") == (0, 0) and ix.num_tier_held("a") == (0, 7)


def test_offload_tier_is_the_replicas_own():
    ix = PrefixIndex(1000, 10.0)
    for rid in ("a", "b"):
        ix.add_replica(rid, "n1")
        ix.apply_events(KVEventBatch(rid, "e0", 0, []))
    p = chain("p", 6)
    # the pool evicted blocks 2-5 into a's offload tier
    ix.apply_events(KVEventBatch("a", "e0", 0, [stored(p), stored(p[2:], MEDIUM_OFFLOAD), removed(p[2:])]))
    pool = ix.match(p, ["a", "b"])
    assert pool == {"a": 2}
    assert ix.match_tiers(p, ["a", "b"], pool) == {"a": 4}
    ix.apply_events(KVEventBatch("a", "e0", 3, [removed(p[4:5], MEDIUM_OFFLOAD)]))
    assert ix.match_tiers(p, ["a", "b"], pool) == {"a": 2}


def test_pool_reset_keeps_tiers_and_a_replica_of_unknown_node_shares_with_nobody():
    ix = PrefixIndex(1000, 10.0)
    ix.add_replica("a", None)
    ix.add_replica("b", None)
    for rid in ("a", "b"):
        ix.apply_events(KVEventBatch(rid, "e0", 0, []))
    p = chain("p", 4)
    ix.apply_events(KVEventBatch("a", "e0", 0, [stored(p), stored(p, MEDIUM_SHARED), AllBlocksCleared()]))
    assert ix.match(p, ["a", "b"]) == {}
    assert ix.match_tiers(p, ["a", "b"], {}) == {"a": 4}       # b's node is unknown: not a's store
    ix.add_replica("b", "n1")
    ix.add_replica("a", "n1")                                   # a's node learnt: a's pseudo-node goes
    assert ix.match_tiers(p, ["a", "b"], {}) == {}
    ix.apply_events(KVEventBatch("a", "e0", 3, [stored(p, MEDIUM_SHARED)]))
    assert ix.match_tiers(p, ["a", "b"], {}) == {"a": 4, "b": 4}
    ix.remove_replica("a")
    assert ix.match_tiers(p, ["b"], {}) == {"b": 4}            # the store outlives one replica
    ix.remove_replica("b")
    assert ix.num_tier_entries == 0                            # nobody left on the node: forgotten


def test_snapshot_resync_restores_pool_offload_and_the_nodes_store():
    ix = PrefixIndex(1000, 10.0)
    for rid in ("a", "b"):
        ix.add_replica(rid, "n1")
        ix.apply_events(KVEventBatch(rid, "e0", 0, []))
    p, q = chain("p", 6), chain("q", 4)
    ix.apply_events(KVEventBatch("a", "e0", 0, [stored(p[:2]), stored(p, MEDIUM_OFFLOAD), stored(q, MEDIUM_SHARED)]))
    assert ix.apply_events(KVEventBatch("a", "e0", 7, [])) is False        # a gap: a's entries dropped
    assert ix.match(p, ["a"]) == {} and ix.match_tiers(p, ["a"], {}) == {}
    assert ix.match_tiers(q, ["b"], {}) == {"b": 4}                        # the node's store stays
    # the snapshot: pool p[:3], offload p[3:], and the whole store (q evicted meanwhile, p[:1] added)
    ix.apply_snapshot(KVSnapshot("a", "e0", 9, p[:3], {MEDIUM_OFFLOAD: p[3:], MEDIUM_SHARED: p[:1]}))
    pool = ix.match(p, ["a", "b"])
    assert pool == {"a": 3}
    assert ix.match_tiers(p, ["a", "b"], pool) == {"a": 3, "b": 1}
    assert ix.match_tiers(q, ["a", "b"], {}) == {}
    assert ix.apply_events(KVEventBatch("a", "e0", 9, [removed(p[5:], MEDIUM_OFFLOAD)]))
    assert ix.match_tiers(p, ["a"], pool) == {"a": 2}


def test_feed_passes_the_engines_tier_snapshot_on(monkeypatch):
    import asyncio

    from affinity_serve.app.routing.feed import KVEventFeed
    core, _ = make()
    p = chain("p", 5)

    class Client:
        async def snapshot(self):
            return KVCacheSnapshot("e1", 4, [], {MEDIUM_SHARED: p})

        async def events_since(self, next_seq, epoch):
            raise AssertionError("a new replica is resynced from a snapshot first")

    async def run():
        feed = KVEventFeed(core, lambda: {"b": Client()}, 1.0, 1.0)
        await asyncio.gather(*feed.tick())

    asyncio.run(run())
    d = core.route(RouteRequest("r", p + chain("r", 1), 6 * BS + 1), ["a", "b", "c"])
    tiers = {c.replica_id: c.predicted_tier_cached_tokens for c in d.candidates}
    assert tiers == {"a": 5 * BS, "b": 5 * BS, "c": 0}


def test_tier_entries_are_bounded_lru():
    ix = PrefixIndex(1000, 10.0, max_tier_blocks=100)
    ix.add_replica("a", "n1")
    ix.apply_events(KVEventBatch("a", "e0", 0, []))
    old, new = chain("old", 60), chain("new", 60)
    ix.apply_events(KVEventBatch("a", "e0", 0, [stored(old, MEDIUM_SHARED)]))
    ix.match_tiers(old[:10], ["a"], {})                      # touched: the head of old stays
    ix.apply_events(KVEventBatch("a", "e0", 1, [stored(new, MEDIUM_OFFLOAD)]))
    assert ix.num_tier_entries <= 100
    assert ix.num_tier_evictions >= 20
    assert ix.match_tiers(new, ["a"], {}) == {"a": 60}
    assert ix.match_tiers(old[:10], ["a"], {}) == {"a": 10}
    assert sum(ix.num_tier_held("a")) == ix.num_tier_entries


# ---------------------------------------------------------------- isolation
def test_a_store_written_under_another_salt_or_model_is_never_counted():
    tokens = list(range(16 * 10))
    mine = hash_block_chain(tokens, BS)
    salted = hash_block_chain(tokens, BS, "tenant-b")
    assert not set(mine) & set(salted)
    core, _ = make()
    feed = Feed(core)
    # b wrote the same tokens under another cache salt (or another model's engine, whose chain differs)
    feed.send("b", stored(salted, MEDIUM_SHARED))
    d = core.route(RouteRequest("r", mine, len(tokens) + 3), ["a", "b", "c"])
    assert all(c.predicted_cached_tokens == 0 for c in d.candidates)
    assert d.reason is Reason.NEW_GROUP


# ---------------------------------------------------------------- the cost model and the decision
def test_pool_hit_is_free_and_tier_hit_costs_its_load():
    core, _ = make()
    feed = Feed(core)
    feed.send("a", stored(PREFIX), stored(PREFIX, MEDIUM_SHARED))
    d = core.route(req("r1"), ["a", "b", "c"])
    a, b, c = (d.score_of(r) for r in "abc")
    assert (a.predicted_cached_tokens, a.predicted_tier_cached_tokens) == (1024, 0)
    assert (b.predicted_cached_tokens, b.predicted_tier_cached_tokens) == (1024, 1024)
    assert (c.predicted_cached_tokens, c.predicted_tier_cached_tokens) == (0, 0)
    uncached = 6 * BS + 4
    assert a.predicted_ttft_s == pytest.approx(uncached / RATE)
    assert b.predicted_ttft_s == pytest.approx(uncached / RATE + 1024 / LOAD_RATE)
    assert c.predicted_ttft_s == pytest.approx((1024 + uncached) / RATE)
    # equally idle: the pool's copy wins (same reuse, no load)
    assert (d.chosen, d.reason, d.affinity_replica_id) == ("a", Reason.AFFINITY, "a")
    assert b.predicted_pool_cached_tokens == 0 and a.predicted_pool_cached_tokens == 1024


def test_a_busy_holder_releases_to_the_least_loaded_replica_that_loads_the_prefix_from_the_store():
    core, _ = make()
    feed = Feed(core)
    feed.send("a", stored(PREFIX), stored(PREFIX, MEDIUM_SHARED))
    core.on_stats("a", ReplicaLoadView(num_queued_prefill_tokens=8000))
    core.on_stats("c", ReplicaLoadView(num_queued_prefill_tokens=100))
    d = core.route(req("r1"), ["a", "b", "c"])
    assert (d.chosen, d.reason, d.affinity_replica_id) == ("b", Reason.RELEASED, "a")
    assert d.score_of("b").predicted_tier_cached_tokens == 1024
    # without the store, the release would have had to recompute the prefix (c, on the other node, still
    # cannot load it): b's predicted TTFT beats a recompute anywhere by the load/prefill rate ratio
    assert d.score_of("b").predicted_ttft_s < d.score_of("c").predicted_ttft_s
    rec = decision_to_dict(d)["candidates"]
    assert [(x["replica_id"], x["predicted_cached_tokens"], x["predicted_tier_cached_tokens"]) for x in rec] == \
        [("a", 1024, 0), ("b", 1024, 1024), ("c", 0, 0)]
    attrs = routing_record(d, "b", 1024).span_attributes()
    assert attrs["routing.candidates.predicted_tier_cached_tokens"] == [0, 1024, 0]
    assert attrs["routing.candidates.predicted_cached_tokens"] == [1024, 1024, 0]


def test_tier_run_continues_a_partial_pool_hit_and_the_routed_replica_holds_it_speculatively():
    core, clock = make()
    feed = Feed(core)
    feed.send("b", stored(PREFIX[:16]), stored(PREFIX, MEDIUM_SHARED))
    d = core.route(req("r1"), ["a", "b", "c"])
    b = d.score_of("b")
    assert (b.predicted_cached_tokens, b.predicted_tier_cached_tokens) == (1024, 768)
    assert d.chosen == "b" and d.reason is Reason.AFFINITY
    # the request's whole prompt now counts as in b's pool (loaded or computed there), until events say
    d2 = core.route(req("r2"), ["a", "b", "c"])
    assert d2.score_of("b").predicted_tier_cached_tokens == 0
    assert d2.score_of("b").predicted_cached_tokens == 1024


def test_the_load_rate_is_calibrated_from_observed_ttfts():
    cfg = AffinityConfig(prefill_tokens_per_s=RATE, tier_load_tokens_per_s=LOAD_RATE, calibration_prior_weight=0.1)
    model = TTFTModel(cfg)
    rng = random.Random(1)
    true_rate, true_load = 5_000.0, 20_000.0         # the replicas are slower than the priors say
    for _ in range(300):
        work, loaded, running = rng.randrange(0, 3000), rng.randrange(0, 4000), rng.randrange(0, 8)
        model.observe(work, running, work / true_rate + loaded / true_load + running * 0.002, loaded)
    assert model.prefill_tokens_per_s == pytest.approx(true_rate, rel=0.05)
    assert model.tier_load_tokens_per_s == pytest.approx(true_load, rel=0.05)
    idle = ReplicaLoad("x")
    assert model.predict_many([idle], [1000], [2000]) == [pytest.approx(1000 / true_rate + 2000 / true_load, rel=0.05)]


def test_the_core_feeds_the_calibration_the_tokens_that_came_from_the_tier():
    core, clock = make(calibrate=True, calibration_prior_weight=0.01)
    Feed(core).send("a", stored(PREFIX, MEDIUM_SHARED))
    for i in range(40):
        d = core.route(req(f"r{i}", extra_blocks=0), ["a"])
        assert d.score_of("a").predicted_tier_cached_tokens == 1024
        clock.t += 1024 / 20_000.0 + 4 / RATE                 # loads run at 20k tokens/s, not the 100k prior
        core.on_first_token(f"r{i}", 1024)
        core.on_finished(f"r{i}")
        fresh = core.route(req(f"f{i}", prefix=chain(f"f{i}", 64), extra_blocks=0), ["a"])   # a recompute
        assert fresh.score_of("a").predicted_cached_tokens == 0
        clock.t += 1028 / RATE
        core.on_first_token(f"f{i}", 0)
        core.on_finished(f"f{i}")
        clock.t += 11.0              # past speculative_ttl_s: no pool event confirmed it, so a tier hit again
    assert core.counters().tier_load_tokens_per_s == pytest.approx(20_000.0, rel=0.1)
    assert core.counters().prefill_tokens_per_s == pytest.approx(RATE, rel=0.1)
