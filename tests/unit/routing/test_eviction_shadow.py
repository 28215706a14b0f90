"""The eviction estimate (app/routing/eviction.py) and the placement it drives: a new group goes where its
blocks evict the least long, reused prefix."""
from __future__ import annotations



from affinity_serve.app.routing import (AffinityConfig, ReplicaInfo,
                                        ReplicaLoadView)
from affinity_serve.app.routing.api import Reason, RouteRequest
from affinity_serve.app.routing.eviction import EvictionShadow

from .helpers import BS, chain, synced_core

RATE = 10_000.0


def test_nothing_is_charged_while_the_pool_has_never_used_room():
    s = EvictionShadow(BS, tail_tokens=0)
    s.set_capacity("r", 1000)
    s.on_route("r", chain("a", 500), 500, 0)
    assert s.cost_s("r", 500, RATE) == 0.0
    assert s.cost_s("r", 600, RATE) > 0.0


def test_the_cost_is_the_coldest_entries_recompute_beyond_the_tail_threshold():
    """Pool 1000 blocks holding a 600-block prefix (used twice) then a 400-block one (used twice): 200 new
    blocks evict the 600-block entry's last 200 blocks (3,200 tokens: under the 4,096-token threshold,
    free); 700 evict all 600 of it (9,600 tokens, 5,504 beyond the threshold) and 100 of the next (under)."""
    s = EvictionShadow(BS, tail_tokens=4096)
    s.set_capacity("r", 1000)
    for name, n in (("long", 600), ("short", 400)):
        s.on_route("r", chain(name, n), n, 0)
        s.on_route("r", chain(name, n), n, n, 2.0)
    assert s.cost_s("r", 200, RATE) == 0.0
    assert s.cost_s("r", 700, RATE) == (600 * BS - 4096) / RATE


def test_a_single_use_entry_counts_at_the_measured_reuse_share():
    s = EvictionShadow(BS, tail_tokens=0)
    s.set_capacity("r", 100)
    s.on_route("r", chain("once", 100), 100, 0)
    p1 = s.single_use_reuse_share()
    assert p1 == 0.5                                          # the prior: one reused, one died
    assert s.cost_s("r", 100, RATE) == 100 * BS * p1 / RATE
    for i in range(4):                                        # four single-use entries leave unused
        s.on_route("r", chain(f"d{i}", 100), 100, 0)
    assert s.single_use_reuse_share() == 1 / 6


def test_a_burst_of_siblings_is_one_use():
    """Siblings sharing a prefix within REUSE_GAP_S are one use: the prefix counts at the single-use share
    until it comes back later."""
    s = EvictionShadow(BS, tail_tokens=0)
    s.set_capacity("r", 100)
    for k in range(10):
        s.on_route("r", chain("burst", 100), 100, 100 if k else 0, 0.002 * k)
    assert s.cost_s("r", 100, RATE) == 100 * BS * s.single_use_reuse_share() / RATE
    s.on_route("r", chain("burst", 100), 100, 100, 5.0)
    assert s.cost_s("r", 100, RATE) == 100 * BS / RATE


def test_use_and_finish_move_an_entry_to_the_recent_end():
    s = EvictionShadow(BS, tail_tokens=0)
    s.set_capacity("r", 200)
    a, b = chain("a", 100), chain("b", 100)
    s.on_route("r", a, 100, 0)
    s.on_route("r", b, 100, 0)
    s.on_route("r", a, 100, 100, 2.0)                         # a reused: b is now the coldest
    assert s.cost_s("r", 100, RATE) == 100 * BS * s.single_use_reuse_share() / RATE
    s.on_finished("r", b)                                     # b freed last: a is the coldest
    assert s.cost_s("r", 100, RATE) == 100 * BS / RATE


def test_past_the_pool_the_oldest_entry_loses_its_tail_first():
    s = EvictionShadow(BS, tail_tokens=0)
    s.set_capacity("r", 1000)
    s.on_route("r", chain("a", 900), 900, 0)
    s.on_route("r", chain("a", 900), 900, 900, 2.0)
    s.on_route("r", chain("b", 300), 300, 0, 3.0)                 # 1,200 > 1,000: a keeps 700 blocks
    assert s.cost_s("r", 700, RATE) == 700 * BS / RATE


def test_a_session_turn_grows_its_entry_by_the_blocks_the_replica_did_not_hold():
    s = EvictionShadow(BS, key_depth=4, tail_tokens=0)
    s.set_capacity("r", 10_000)
    s.on_route("r", chain("s", 100), 110, 0)                   # prompt + output: 110 blocks
    s.on_route("r", chain("s", 150), 160, 110, 10.0)           # next turn: 50 new blocks
    assert s._total["r"] == 160


def _core(n=2, **cfg):
    core, clock, ids = synced_core(n, RATE, **cfg)
    for r in ids:
        core.on_stats(r, ReplicaLoadView(num_blocks=1000))
    return core, clock, ids


def test_a_new_long_group_goes_where_it_evicts_no_long_reused_prefix():
    """r0's pool is full of one 900-block prefix used twice, r1's of nine 100-block ones: a new 800-block
    prompt that fits neither without eviction goes to r1 (it evicts short prefixes there) with the estimate
    on, and to r0 (the less loaded, by the TTFT model alone) with it off."""
    for weight, expect in ((1.0, "r1"), (0.0, "r0")):
        core, clock, ids = _core(evict_cost_weight=weight)
        core.on_stats("r0", ReplicaLoadView(num_blocks=1000))
        core.on_stats("r1", ReplicaLoadView(num_blocks=1000, num_queued_prefill_tokens=500))
        if weight:
            core.shadow.set_capacity("r0", 1000)
            core.shadow.set_capacity("r1", 1000)
            core.shadow.on_route("r0", chain("long", 900), 900, 0)
            core.shadow.on_route("r0", chain("long", 900), 900, 900, 2.0)
            for i in range(9):
                core.shadow.on_route("r1", chain(f"short{i}", 100), 100, 0)
                core.shadow.on_route("r1", chain(f"short{i}", 100), 100, 100, 2.0)
        d = core.route(RouteRequest("new", chain("fresh", 800), 800 * BS + 1, 1), ids)
        assert d.reason == Reason.NEW_GROUP and d.chosen == expect


def test_the_router_feeds_the_shadow_from_its_own_decisions():
    core, clock, ids = _core(evict_cost_weight=1.0, evict_tail_tokens=0)
    d = core.route(RouteRequest("a", chain("a", 300), 300 * BS + 1, 1), ids)
    assert core.shadow._total[d.chosen] == 301                 # prompt + its output token: 301 blocks
    core.on_first_token("a")
    core.on_finished("a", 1)
    assert core.shadow.cost_s(d.chosen, 1000, RATE) > 0.0
    assert core.shadow.cost_s(d.chosen, 699, RATE) == 0.0
    core.set_replicas([ReplicaInfo(r) for r in ids if r != d.chosen])
    assert core.shadow.cost_s(d.chosen, 1000, RATE) == 0.0


def test_off_by_default():
    assert AffinityConfig().evict_cost_weight == 0.0
    core, _, _ = _core()
    assert core.shadow is None

