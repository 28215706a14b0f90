"""The router at fleet scale and under overload (issue 25's causes): an index sized from what the replicas
report, decisions whose work does not grow with the prompt, a release that weighs the recompute it causes,
snapshots applied as of when they were taken, and group demand from observed output lengths."""
from __future__ import annotations


import pytest

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, ReplicaInfo,
                                        ReplicaLoadView)
from affinity_serve.app.routing.api import Reason, RouteRequest
from affinity_serve.app.routing.prefix_index import SPEC_STRIDE
from affinity_serve.app.stats import ROUTING_STATS_FIELDS
from affinity_serve.engine.types import BlockStored

from .helpers import BS, chain, stored, synced_core

RATE = 10_000.0


def make(n: int = 3, **cfg):
    return synced_core(n, RATE, **cfg)


def stats(core, rid, **kw):
    core.on_stats(rid, ReplicaLoadView(**kw))


def score(d, rid):
    return d.score_of(rid)


# ---------------------------------------------------------------- 1. the index is sized from the fleet
def test_the_index_holds_every_live_block_of_a_fleet_past_the_old_fixed_default():
    """64 replicas x 8,000 held blocks = 512k hashes: past the old fixed 500k bound, which evicted live
    entries; sized from the reported pools (64 x 8,192 x 1.25) nothing is evicted and every chain matches."""
    core, _, ids = make(64)
    for r in ids:
        stats(core, r, num_blocks=8192)
    assert core.index.bound == int(64 * 8192 * 1.25)
    for r in ids:
        core.on_kv_events(KVEventBatch(r, "e0", 0, [BlockStored(chain(r, 8000), None, [], BS)]))
    assert core.index.num_entries == 64 * 8000 and core.index.num_evictions == 0
    assert core.index.match(chain("r0", 8000), ids) == {"r0": 8000}
    assert core.index.match(chain("r63", 8000), ids) == {"r63": 8000}


def test_membership_and_reported_sizes_resize_the_index_up_to_the_cap():
    core, _, ids = make(2, max_index_entries=100_000, index_blocks_per_unknown_replica=1000)
    assert core.index.bound == int(2 * 1000 * 1.25)             # not reported yet: the per-replica default
    stats(core, "r0", num_blocks=30_000)
    assert core.index.bound == int((30_000 + 1000) * 1.25)
    core.set_replicas([ReplicaInfo(r) for r in ids + ["r2", "r3", "r4"]])
    stats(core, "r1", num_blocks=30_000)
    for r in ("r2", "r3", "r4"):
        stats(core, r, num_blocks=30_000)
    assert core.index.bound == 100_000                          # max_index_entries caps it
    core.set_replicas([ReplicaInfo("r0")])
    assert core.index.bound == int(30_000 * 1.25)


# ---------------------------------------------------------------- 2-3. bounded work per decision
def test_decisions_on_32k_token_prompts_never_evict_and_write_a_bounded_number_of_entries():
    """A tight index: routing 200 distinct 2,048-block prompts neither evicts a confirmed entry (eviction
    runs on the event path, exactly the overage) nor writes more than ~n/16 speculative entries each."""
    core, clock, ids = make(8)
    for r in ids:
        stats(core, r, num_blocks=600)                          # bound 8 x 600 x 1.25 = 6,000
    held = chain("sys", 500)
    core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(held)]))
    per_decision = []
    for i in range(200):
        clock.t += 0.01
        before = core.index.num_spec_entries
        d = core.route(RouteRequest(f"q{i}", chain(f"long{i}", 2048), 2048 * BS + 5, 64), ids)
        per_decision.append(core.index.num_spec_entries - before)
        core.on_first_token(d.req_id, 0)
        core.on_finished(d.req_id, 64)
    assert core.index.num_evictions == 0 and core.index.num_entries == 500
    assert max(per_decision) <= 2048 // SPEC_STRIDE + 5
    assert core.index.num_spec_entries <= core.index.bound // 4 + 2048 // SPEC_STRIDE + 5
    assert core.index.match(held, ids) == {"r0": 500}


# ---------------------------------------------------------------- 4. the release rule under overload
def _release_case(idle_other: bool):
    # the relative and absolute slack of the old defaults: what keeps the request is the recompute term
    core, clock, ids = make(3, release_slack=0.3, release_slack_abs_s=0.1)
    prefix = chain("tenant", 15_000 // BS)                     # 15k of a 16k-token prompt held by r0
    core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(prefix)]))
    stats(core, "r0", num_queued_prefill_tokens=40_000, num_running=0)
    stats(core, "r1", num_queued_prefill_tokens=10_000, num_running=0)
    stats(core, "r2", num_queued_prefill_tokens=0 if idle_other else 12_000, num_running=0)
    clock.t += 0.01
    hashes = prefix + chain("question", 1000 // BS)
    return core.route(RouteRequest("q", hashes, 16_000 + 3, 32), ids)


def test_a_saturated_fleet_keeps_a_request_whose_holder_has_most_of_its_prompt():
    """Every replica queued (>= 1 s of prefill): moving gives up 15k cached tokens, 1.5 s of the fleet's
    prefill; TTFT(r0) = 4.1 s is under TTFT(r1) x 1.3 + 0.1 + 1.5 s, so it stays (the old rule released)."""
    d = _release_case(idle_other=False)
    assert d.chosen == "r0" and d.reason == Reason.AFFINITY
    assert score(d, "r0").predicted_ttft_s > score(d, "r1").predicted_ttft_s * 1.3 + 0.1   # old bound: release


def test_with_an_idle_replica_the_release_uses_spare_capacity():
    d = _release_case(idle_other=True)
    assert d.chosen == "r2" and d.reason == Reason.RELEASED


def _release_to_idle_case(other_fill_blocks: int, holder_queue: int = 40_000, **cfg):
    """r0 holds 15k of a 16k-token prompt behind `holder_queue` tokens of queue (4 s by default); r2 is idle
    (the fleet is not saturated) and its 2,000-block pool holds `other_fill_blocks` blocks of other
    prefixes."""
    cfg.setdefault("release_slack", 0.3)
    cfg.setdefault("release_slack_abs_s", 0.1)
    core, clock, ids = make(3, **cfg)
    prefix = chain("tenant", 15_000 // BS)
    core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(prefix)]))
    if other_fill_blocks:
        core.on_kv_events(KVEventBatch("r2", "e0", 0, [stored(chain("others", other_fill_blocks))]))
    for r, q in (("r0", holder_queue), ("r1", 10_000), ("r2", 0)):
        stats(core, r, num_queued_prefill_tokens=q, num_blocks=2000)
    clock.t += 0.01
    return core.route(RouteRequest("q", prefix + chain("question", 1000 // BS), 16_003, 32), ids)


def test_a_release_onto_a_full_pool_pays_for_the_prefix_it_evicts():
    """An idle replica makes the prefill-saturation term 0, but its full pool would evict 15k cached tokens
    of other prefixes for the copy: TTFT(r0) = 4.1 s is under TTFT(r2) 1.6 s x 1.3 + 0.1 s + 3 x 1.0 x
    1.5 s of recompute, so the request stays with its holder (before release_cache_weight it moved)."""
    d = _release_to_idle_case(other_fill_blocks=2000, release_cache_weight=3.0)
    assert d.chosen == "r0" and d.reason == Reason.AFFINITY
    assert score(d, "r0").predicted_ttft_s > score(d, "r2").predicted_ttft_s * 1.3 + 0.1 + 1.5


def test_a_release_onto_an_empty_pool_uses_its_room_and_spare_capacity():
    d = _release_to_idle_case(other_fill_blocks=0, release_cache_weight=3.0)
    assert d.chosen == "r2" and d.reason == Reason.RELEASED


def test_cache_weight_zero_releases_onto_a_full_pool():
    """Weight 0: the cache fill does not count, the old rule."""
    d = _release_to_idle_case(other_fill_blocks=2000, release_cache_weight=0.0)
    assert d.chosen == "r2" and d.reason == Reason.RELEASED


def test_the_default_cache_weight_keeps_a_request_whose_move_would_evict_more_than_it_saves():
    """Default weight 0.5: r0 has 2.5 s of queue, r2 (idle, full pool) predicts 1.6 s. The slack alone
    (1.6 x 1.3 + 0.1 = 2.18 s) would release; half the 1.5 s recompute on a full pool (0.75 s) keeps the
    request with its holder. The same move onto an empty pool, or with a 4 s queue, still happens."""
    assert AffinityConfig().release_cache_weight == 0.5
    d = _release_to_idle_case(other_fill_blocks=2000, holder_queue=25_000)
    assert d.chosen == "r0" and d.reason == Reason.AFFINITY
    assert score(d, "r0").predicted_ttft_s > score(d, "r2").predicted_ttft_s * 1.3 + 0.1
    d = _release_to_idle_case(other_fill_blocks=0, holder_queue=25_000)
    assert d.chosen == "r2" and d.reason == Reason.RELEASED
    d = _release_to_idle_case(other_fill_blocks=2000)
    assert d.chosen == "r2" and d.reason == Reason.RELEASED


def test_recompute_weight_zero_is_the_old_rule():
    core, clock, ids = make(3, release_recompute_weight=0.0, release_cache_weight=0.0, release_slack=0.3,
                            release_slack_abs_s=0.1)
    prefix = chain("tenant", 15_000 // BS)
    core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(prefix)]))
    for r, q in (("r0", 40_000), ("r1", 10_000), ("r2", 12_000)):
        stats(core, r, num_queued_prefill_tokens=q)
    d = core.route(RouteRequest("q", prefix + chain("question", 1000 // BS), 16_003, 32), ids)
    assert d.reason == Reason.RELEASED and d.chosen == "r1"


# ---------------------------------------------------------------- 5. snapshots as of when they were taken
def test_a_request_routed_while_the_snapshot_was_on_its_way_stays_counted():
    core, clock, ids = make(1)
    d = core.route(RouteRequest("r1", chain("p", 10), 10 * BS + 4, 8), ids)
    uncached = 10 * BS + 4
    clock.t += 1.0
    # taken 2 s ago, before r1 was routed: r1 is not in it and must stay on top
    stats(core, "r0", num_queued_prefill_tokens=300, num_running=2, age_s=2.0)
    d2 = core.route(RouteRequest("r2", chain("q", 10), 10 * BS + 4, 8), ids)
    assert score(d2, "r0").queued_prefill_tokens == 300 + uncached
    assert score(d2, "r0").decode_load == 2 + 1
    # taken just now (after both were routed): it counts them itself
    clock.t += 0.5
    stats(core, "r0", num_queued_prefill_tokens=900, num_running=2)
    d3 = core.route(RouteRequest("r3", chain("s", 10), 10 * BS + 4, 8), ids)
    assert score(d3, "r0").queued_prefill_tokens == 900 and score(d3, "r0").decode_load == 2
    assert d.chosen == "r0"


def test_a_snapshot_taken_before_a_request_started_retires_it_once():
    core, clock, ids = make(1)
    core.route(RouteRequest("r1", chain("p", 10), 10 * BS + 4, 8), ids)
    clock.t += 0.5
    stats(core, "r0", num_queued_prefill_tokens=10 * BS + 4, num_running=0)   # r1 queued in it
    clock.t += 0.5
    core.on_first_token("r1", 0)                                  # started since: its tokens come off
    d = core.route(RouteRequest("r2", chain("q", 10), 10 * BS + 4, 8), ids)
    assert score(d, "r0").queued_prefill_tokens == 0
    # the same snapshot delivered again (Serve rebroadcasts) changes nothing
    stats(core, "r0", num_queued_prefill_tokens=10 * BS + 4, num_running=0, age_s=0.5)
    d = core.route(RouteRequest("r3", chain("s", 10), 10 * BS + 4, 8), ids)
    assert score(d, "r0").queued_prefill_tokens == 10 * BS + 4                # r2 only, pending


def test_replica_stats_carry_their_wall_time_and_the_view_its_age():
    view = ReplicaLoadView.from_stats({"num_running_reqs": 1, "taken_at": 1000.0}, now_wall=1000.75)
    assert view.age_s == pytest.approx(0.75)
    assert ReplicaLoadView.from_stats({"num_running_reqs": 1}).age_s == 0.0
    assert "num_running_reqs" in ROUTING_STATS_FIELDS      # the view reads EngineLoad's names


# ---------------------------------------------------------------- 6. demand from observed output lengths
def test_an_unset_max_tokens_does_not_make_a_group_hot_once_outputs_are_observed():
    """Chat clients without max_tokens get max_model_len - prompt (here 30k): demand from that would spread
    a 5 req/s group over every replica; its observed 20-token answers keep it on one."""
    def drive(report_outputs: bool):
        core, clock, ids = make(3, hot_target_utilization=0.5, hot_share_min_requests=1000)
        prefix = chain("sys", 64)
        core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(prefix)]))
        out = []
        for i in range(40):
            clock.t += 0.2
            d = core.route(RouteRequest(f"h{i}", prefix + chain(f"u{i}", 2), 66 * BS + 3, 30_000), ids)
            out.append(d)
            core.on_first_token(d.req_id, 64 * BS)
            core.on_finished(d.req_id, 20 if report_outputs else None)
        return out
    observed = drive(True)
    assert all(d.num_hot_replicas == 1 for d in observed)
    assert {d.chosen for d in observed} == {"r0"}
    # the declared 30k would be 60k prefill-token equivalents per request: 300k/s against 5k/s of capacity
    core, clock, ids = make(3, hot_target_utilization=0.5, hot_share_min_requests=1000, output_tokens_prior=30_000)
    core.on_kv_events(KVEventBatch("r0", "e0", 0, [stored(chain("sys", 64))]))
    for i in range(10):
        clock.t += 0.2
        d = core.route(RouteRequest(f"h{i}", chain("sys", 64) + chain(f"u{i}", 2), 66 * BS + 3, 30_000), ids)
    assert d.num_hot_replicas == 3


def test_expected_output_prefers_the_group_then_the_fleet_then_the_prior():
    from affinity_serve.app.routing.policy import HotGroups
    g = HotGroups(10.0, output_tokens_prior=256.0)
    assert g.expected_output(b"k", 0) == 256.0 and g.expected_output(b"k", 100) == 100
    g.record(b"k", 1.0, 0.0)
    g.observe_output(b"k", 40)
    assert g.expected_output(b"k", 0) == 40.0 and g.expected_output(b"other", 0) == 40.0
    g.observe_output(None, 400)
    assert g.expected_output(b"k", 0) == 40.0 and g.expected_output(b"other", 0) == pytest.approx(112.0)


def test_kv_usage_counts_the_blocks_of_requests_sent_since_the_snapshot():
    """A burst sent between two snapshots must not find the pool as empty as it was: each request sent
    since adds the blocks it will hold (prompt + expected output), and a finished one that held blocks in
    the snapshot gives them back."""
    core, clock, ids = make(1)
    stats(core, "r0", kv_cache_usage=0.5, num_blocks=100)
    clock.t += 0.1
    d = core.route(RouteRequest("a", chain("a", 20), 20 * BS + 4, 40), ids)     # 324 + 40 tokens: 23 blocks
    d2 = core.route(RouteRequest("b", chain("b", 2), 2 * BS + 4, 8), ids)
    assert score(d2, "r0").kv_usage == pytest.approx(0.5 + 23 / 100)
    clock.t += 0.1
    stats(core, "r0", kv_cache_usage=0.75, num_blocks=100)                       # taken after both
    core.on_first_token("a", 0)
    d3 = core.route(RouteRequest("c", chain("c", 2), 2 * BS + 4, 8), ids)
    assert score(d3, "r0").kv_usage == pytest.approx(0.75)
    core.on_finished("a", 40)                                                    # a held 23 blocks in it
    d4 = core.route(RouteRequest("e", chain("e", 2), 2 * BS + 4, 8), ids)
    assert score(d4, "r0").kv_usage == pytest.approx(0.75 + 3 / 100 - 23 / 100)
    assert d.chosen == "r0"


def test_kv_pressure_is_judged_with_the_request_in_the_pool():
    """A long prompt that would not fit a replica's pool (usage 0.7 + its 2,000 new blocks of 5,000) waits
    for running requests to finish there: it goes to the emptier pool even with more queued ahead."""
    core, clock, ids = make(2, kv_pressure_threshold=0.9, kv_pressure_penalty_s=1.0)
    stats(core, "r0", kv_cache_usage=0.7, num_blocks=5000, num_queued_prefill_tokens=0)
    stats(core, "r1", kv_cache_usage=0.2, num_blocks=5000, num_queued_prefill_tokens=3000)
    clock.t += 0.1
    d = core.route(RouteRequest("long", chain("long", 2000), 2000 * BS + 5, 16), ids)
    assert d.chosen == "r1"
    assert score(d, "r0").predicted_ttft_s > score(d, "r1").predicted_ttft_s
    # a short one fits either pool: the shorter queue wins
    d2 = core.route(RouteRequest("short", chain("short", 4), 4 * BS + 5, 16), ids)
    assert d2.chosen == "r0"


def test_at_threshold_one_only_a_request_that_does_not_fit_pays_the_kv_penalty():
    """The default: a pool 95% full costs a request that fits in it nothing (a small pool must not shed its
    cached prefixes' requests early); one that does not fit pays in proportion to its overage."""
    core, clock, ids = make(2, kv_pressure_threshold=1.0, kv_pressure_penalty_s=1.0)
    stats(core, "r0", kv_cache_usage=0.95, num_blocks=1000, num_queued_prefill_tokens=0)
    stats(core, "r1", kv_cache_usage=0.0, num_blocks=1000, num_queued_prefill_tokens=0)
    clock.t += 0.1
    fits = core.route(RouteRequest("fits", chain("fits", 20), 20 * BS + 5, 8), ids)
    assert score(fits, "r0").predicted_ttft_s == pytest.approx(score(fits, "r1").predicted_ttft_s)
    big = core.route(RouteRequest("big", chain("big", 300), 300 * BS + 5, 8), ids)     # 0.95 + 0.3 > 1
    assert big.chosen == "r1"
    own_prefill_s = (300 * BS + 5) / core.model.prefill_tokens_per_s
    overage = score(big, "r0").kv_usage + 301 / 1000 - 1.0     # its uncached prompt and expected output
    assert score(big, "r0").predicted_ttft_s == pytest.approx(own_prefill_s + overage, abs=0.02)
