"""PrefixAffinityRouterCore + AffinityPolicy with hand-built stats and events, an injected clock and rng."""
from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from affinity_serve.app.routing import (AffinityConfig, KVEventBatch, PrefixAffinityRouterCore, Reason, ReplicaInfo,
                         ReplicaLoadView, RouteRequest)

from .helpers import BS, Clock, chain, stored

RATE = 10_000.0          # prior prefill tokens/s in these tests
PREFIX = chain("sys", 64)                     # 1024 tokens


def make(replicas=(("a", "n1"), ("b", "n1"), ("c", "n2")), seed=0, **cfg):
    cfg.setdefault("calibrate", False)
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(prefill_tokens_per_s=RATE, **cfg), BS, clock=clock,
                                    rng=random.Random(seed))
    core.set_replicas([ReplicaInfo(r, n) for r, n in replicas])
    for r, _ in replicas:
        assert core.on_kv_events(KVEventBatch(r, "e0", 0, []))
    return core, clock


def req(rid: str, prefix=PREFIX, suffix: str | None = None, extra_blocks=6, max_tokens=0, node=None):
    hashes = list(prefix) + chain(suffix or rid, extra_blocks)
    return RouteRequest(rid, hashes, len(hashes) * BS + 4, max_tokens, node)


def hold(core, rid: str, hashes, seq: int = 0):
    assert core.on_kv_events(KVEventBatch(rid, "e0", seq, [stored(hashes)]))


def stats(core, rid: str, **kw):
    core.on_stats(rid, ReplicaLoadView(**kw))


def done(core, rid: str):
    core.on_first_token(rid)
    core.on_finished(rid)


def score(decision, rid):
    found = decision.score_of(rid)
    assert found is not None and found in decision.candidates
    return found


# ---------------------------------------------------------------- affinity and release
def test_affinity_is_kept_while_the_holder_is_within_the_slack():
    core, _ = make()
    hold(core, "a", PREFIX)
    stats(core, "a", num_queued_prefill_tokens=2000)
    d = core.route(req("r1"), ["a", "b", "c"])
    assert (d.chosen, d.reason, d.affinity_replica_id) == ("a", Reason.AFFINITY, "a")
    assert score(d, "a").predicted_cached_tokens == 1024 and score(d, "b").predicted_cached_tokens == 0
    assert score(d, "a").queued_prefill_tokens == 2000
    assert score(d, "a").predicted_ttft_s == pytest.approx((2000 + 100) / RATE)
    assert d.ranked[0] == "a" and sorted(d.ranked) == ["a", "b", "c"]


def test_affinity_is_released_to_the_best_ttft_when_the_holder_is_too_slow():
    core, _ = make()
    hold(core, "a", PREFIX)
    stats(core, "a", num_queued_prefill_tokens=5000)
    stats(core, "c", num_running=20)
    d = core.route(req("r1"), ["a", "b", "c"])
    assert (d.chosen, d.reason, d.affinity_replica_id) == ("b", Reason.RELEASED, "a")
    # the release is per request: once a drains, the group goes back to it
    stats(core, "a", num_queued_prefill_tokens=0)
    assert core.route(req("r2"), ["a", "c"]).reason == Reason.AFFINITY


def test_release_bound_is_relative_plus_absolute_slack():
    core, _ = make(release_slack=0.5, release_slack_abs_s=0.0)
    hold(core, "a", PREFIX)
    other = 1124 / RATE                                          # b and c: the whole prompt
    stats(core, "a", num_queued_prefill_tokens=int(1.5 * other * RATE) - 100)
    assert core.route(req("r1"), ["a", "b"]).reason == Reason.AFFINITY
    core.on_finished("r1")
    stats(core, "a", num_queued_prefill_tokens=int(1.5 * other * RATE) - 100 + 2)
    assert core.route(req("r2"), ["a", "b"]).reason == Reason.RELEASED


def test_the_longest_match_is_the_affinity_replica():
    core, _ = make()
    hold(core, "a", PREFIX[:10])
    hold(core, "b", PREFIX)
    d = core.route(req("r1"), ["a", "b", "c"])
    assert (d.chosen, d.reason) == ("b", Reason.AFFINITY)
    assert score(d, "a").predicted_cached_tokens == 160


def test_kv_pressure_releases_the_holder():
    core, _ = make(kv_pressure_threshold=0.9)              # the ramp: full penalty at a full pool
    hold(core, "a", PREFIX)
    stats(core, "a", kv_cache_usage=1.0)
    d = core.route(req("r1"), ["a", "b"])
    assert (d.chosen, d.reason) == ("b", Reason.RELEASED)
    assert score(d, "a").predicted_ttft_s == pytest.approx(100 / RATE + 1.0)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    core, _ = make()
    hold(core, "a", PREFIX)
    r = RouteRequest("r1", PREFIX, 1024, 0)
    assert score(core.route(r, ["a"]), "a").predicted_cached_tokens == 1008


def test_sibling_bursts_follow_the_first_decision_before_any_event():
    core, _ = make()
    first = core.route(req("s0", suffix="q0"), ["a", "b", "c"])
    assert first.reason == Reason.NEW_GROUP
    later = [core.route(req(f"s{i}", suffix=f"q{i}"), ["a", "b", "c"]) for i in range(1, 8)]
    assert {d.chosen for d in later} == {first.chosen}
    assert all(d.reason == Reason.AFFINITY for d in later)


def test_spill_when_only_non_candidates_hold_the_prefix():
    core, _ = make()
    hold(core, "a", PREFIX)
    d = core.route(req("r1"), ["b", "c"])
    assert d.reason == Reason.SPILL and d.chosen in ("b", "c")


# ---------------------------------------------------------------- new groups, ties, hot groups
def test_new_groups_go_where_the_cache_has_room():
    core, _ = make()
    stats(core, "a", kv_cache_usage=0.9)
    stats(core, "b", kv_cache_usage=0.2)
    stats(core, "c", kv_cache_usage=0.5)
    d = core.route(req("r1", prefix=chain("fresh", 8)), ["a", "b", "c"])
    assert (d.chosen, d.reason) == ("b", Reason.NEW_GROUP)


def test_new_group_room_uses_the_indexed_share_of_the_pool_when_its_size_is_known():
    core, _ = make()
    hold(core, "a", chain("big", 90))
    hold(core, "b", chain("small", 10))
    stats(core, "a", num_blocks=100, kv_cache_usage=0.1)
    stats(core, "b", num_blocks=100, kv_cache_usage=0.1)
    d = core.route(req("r1", prefix=chain("fresh", 8)), ["a", "b"])
    assert (d.chosen, d.reason) == ("b", Reason.NEW_GROUP)


def test_a_burst_of_new_groups_does_not_herd_onto_the_roomiest_replica():
    """Room breaks load ties only: the roomy replica's own pending requests soon take it out of the tie."""
    core, _ = make()
    hold(core, "a", chain("big", 60))
    stats(core, "a", num_blocks=100)
    stats(core, "b", num_blocks=100)
    chosen = [core.route(req(f"r{i}", prefix=chain(f"burst{i}", 2)), ["a", "b"]).chosen for i in range(16)]
    picks = Counter(chosen)
    assert chosen[0] == "b"                      # the first new group goes where the room is
    assert picks["b"] >= picks["a"] >= 6         # then load spreads the burst (the old room charge sent all 16 to b)


def test_near_ties_are_random_and_prefer_the_callers_node():
    core, _ = make()
    picks = Counter()
    for i in range(300):
        d = core.route(req(f"r{i}", prefix=chain(f"u{i}", 4)), ["a", "b", "c"])
        picks[d.chosen] += 1
        done(core, f"r{i}")
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60
    on_n1 = set()
    for i in range(50):
        on_n1.add(core.route(req(f"x{i}", prefix=chain(f"v{i}", 4), node="n1"), ["a", "b", "c"]).chosen)
        done(core, f"x{i}")
    assert on_n1 == {"a", "b"}
    assert core.route(req("y", prefix=chain("w", 4), node="n2"), ["a", "b", "c"]).chosen == "c"


def test_same_seed_same_decisions():
    runs = []
    for _ in range(2):
        core, _ = make(seed=7)
        runs.append([core.route(req(f"r{i}", prefix=chain(f"u{i}", 4)), ["a", "b", "c"]).chosen
                     for i in range(20)])
    assert runs[0] == runs[1]


def _drive_group(core, clock, n: int, gap_s: float):
    out = []
    for i in range(n):
        clock.t += gap_s
        d = core.route(req(f"h{i}", max_tokens=1000), ["a", "b", "c"])
        out.append(d)
        done(core, f"h{i}")
    return out


def test_a_hot_prefix_is_spread_over_k_replicas_sized_by_its_demand():
    core, clock = make(hot_target_utilization=0.5, decode_token_weight=2.0)
    hold(core, "a", PREFIX)
    decisions = _drive_group(core, clock, 60, gap_s=0.05)      # ~20 req/s x 2100 tok-eq = 42k tok/s
    late = decisions[20:]
    assert all(d.reason == Reason.HOT_REPLICA and d.num_hot_replicas == 3 for d in late)
    counts = Counter(d.chosen for d in late)
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) >= 8


def test_a_continuation_of_a_hot_group_keeps_its_affinity():
    """A hot group spreads requests whose only reuse is the group's common prefix; a session's next turn,
    which matches deeper on one replica, stays there (spreading those costs hit rate under pressure)."""
    core, clock = make(hot_target_utilization=0.5, decode_token_weight=2.0)
    hold(core, "a", PREFIX)
    _drive_group(core, clock, 40, gap_s=0.05)
    session = list(PREFIX) + chain("s1", 6)
    hold(core, "b", session, seq=0)
    hold(core, "c", PREFIX, seq=0)
    clock.t += 0.05
    turn2 = RouteRequest("s1-t2", session + chain("s1-t2", 3), (len(session) + 3) * BS + 4, 1000, None)
    d = core.route(turn2, ["a", "b", "c"])
    assert d.num_hot_replicas == 3
    assert (d.chosen, d.reason) == ("b", Reason.AFFINITY)
    assert score(d, "b").predicted_cached_tokens == len(session) * BS
    done(core, "s1-t2")
    clock.t += 0.05
    fresh = core.route(req("fresh", max_tokens=1000), ["a", "b", "c"])    # only the common prefix: spread
    assert fresh.reason == Reason.HOT_REPLICA and fresh.num_hot_replicas == 3


def test_a_busy_group_spreads_by_its_share_even_when_prefill_is_cheap():
    """Demand counted in prefill-token equivalents can stay under one replica's (fast) prefill rate while the
    group is most of the traffic: it must still spread over about share x N replicas, or its holder carries
    N x the mean decode load. Here: one group is 9 of every 10 requests over 3 replicas -> all 3."""
    core, clock = make(hot_target_utilization=1.0, hot_window_s=1000.0)   # ~1k tok/s: under one replica
    hold(core, "a", PREFIX)
    late = []
    for i in range(120):
        clock.t += 0.1
        if i % 10 == 9:
            d = core.route(req(f"o{i}", prefix=chain(f"other{i}", 4)), ["a", "b", "c"])
        else:
            d = core.route(req(f"h{i}"), ["a", "b", "c"])
            late.append(d) if i >= 60 else None
        done(core, d.req_id)
    assert {d.num_hot_replicas for d in late} == {3}
    assert set(Counter(d.chosen for d in late)) == {"a", "b", "c"}


def test_a_cold_prefix_stays_on_one_replica():
    core, clock = make(hot_target_utilization=0.5, decode_token_weight=2.0)
    hold(core, "a", PREFIX)
    decisions = _drive_group(core, clock, 30, gap_s=2.0)       # 0.5 req/s: ~1k tok/s, under one replica
    assert {(d.chosen, d.reason, d.num_hot_replicas) for d in decisions} == {("a", Reason.AFFINITY, 1)}


def test_hot_demand_decays_after_the_window():
    core, clock = make(hot_target_utilization=0.5, hot_window_s=5.0)
    hold(core, "a", PREFIX)
    _drive_group(core, clock, 60, gap_s=0.05)
    clock.t += 6.0
    d = core.route(req("late", max_tokens=1000), ["a", "b", "c"])
    assert d.num_hot_replicas == 1 and d.reason == Reason.AFFINITY


# ---------------------------------------------------------------- load accounting and calibration
def test_in_flight_load_is_counted_until_started_and_snapshots_take_over():
    core, clock = make()
    d1 = core.route(req("r1", prefix=chain("p1", 4)), ["a"])
    uncached = score(d1, "a").predicted_ttft_s * RATE
    d2 = core.route(req("r2", prefix=chain("p2", 4)), ["a"])
    assert score(d2, "a").queued_prefill_tokens == round(uncached)
    assert score(d2, "a").decode_load == 1
    core.on_first_token("r1")
    clock.t += 0.1
    stats(core, "a", num_queued_prefill_tokens=500, num_running=3)     # r2 is in this snapshot
    d3 = core.route(req("r3", prefix=chain("p3", 4)), ["a"])
    assert score(d3, "a").queued_prefill_tokens == 500 and score(d3, "a").decode_load == 3
    core.on_first_token("r2")                                           # retired from the snapshot's queue
    core.on_finished("r1")
    d4 = core.route(req("r4", prefix=chain("p4", 4)), ["a"])
    r2_r3_uncached = 10 * BS + 4
    assert score(d4, "a").queued_prefill_tokens == 500 - r2_r3_uncached + r2_r3_uncached   # -r2 +r3
    assert score(d4, "a").decode_load == 3 - 1 + 1


def test_a_lost_finish_stops_counting_after_max_age():
    core, clock = make(max_in_flight_age_s=30.0)
    core.route(req("r1", prefix=chain("p1", 4)), ["a"])
    clock.t += 31.0
    d = core.route(req("r2", prefix=chain("p2", 4)), ["a"])
    assert score(d, "a").queued_prefill_tokens == 0


def test_on_routed_moves_the_load_and_the_speculative_blocks():
    core, _ = make()
    d = core.route(req("r1"), ["a"])
    assert d.chosen == "a"
    core.on_routed("r1", "b")
    d2 = core.route(req("r2", suffix="other"), ["a", "b"])
    assert score(d2, "a").queued_prefill_tokens == 0 and score(d2, "b").queued_prefill_tokens == 1124
    assert score(d2, "b").predicted_cached_tokens == 1024
    assert core.counters().num_rerouted == 1


def test_a_request_prefilled_elsewhere_counts_no_queued_prefill_here_and_keeps_that_when_moved():
    """P/D (LoadTracker.prefill_elsewhere): the prefill pool prefills it, so neither the replica it was routed
    to nor the one it moves to counts its prompt as queued prefill; it still counts as decode load there, and
    a snapshot taken before it and its first token retire nothing (no negative queue)."""
    core, clock = make()
    core.route(req("r1", suffix="x"), ["a"])
    core.loads.prefill_elsewhere("r1")
    d = core.route(req("r2", suffix="y"), ["a", "b"])
    assert score(d, "a").queued_prefill_tokens == 0 and score(d, "a").decode_load == 1
    core.on_routed("r1", "b")
    d = core.route(req("r3", suffix="z"), ["a", "b"])
    assert score(d, "b").decode_load == 1
    assert score(d, "b").queued_prefill_tokens == 0 and core.loads.in_flight("r1").remote
    clock.t += 0.1
    stats(core, "b", num_queued_prefill_tokens=0, num_running=0)
    core.on_first_token("r1")
    d = core.route(req("r4", suffix="w"), ["b"])
    assert score(d, "b").queued_prefill_tokens == 0


def test_the_prefill_rate_and_step_cost_are_calibrated_from_observed_ttfts():
    core, clock = make(calibrate=True, decode_step_s=0.002)
    rng = random.Random(3)
    for i in range(300):
        q, running = rng.randrange(0, 20_000), rng.randrange(0, 64)
        stats(core, "a", num_queued_prefill_tokens=q, num_running=running)
        r = req(f"r{i}", prefix=chain(f"c{i}", 4), extra_blocks=rng.randrange(1, 100))
        core.route(r, ["a"])
        clock.t += (q + r.num_prompt_tokens) / 4000.0 + running * 0.01
        core.on_first_token(r.req_id, num_cached_tokens=0)
        core.on_finished(r.req_id)
    c = core.counters()
    assert c.prefill_tokens_per_s == pytest.approx(4000, rel=0.05)
    assert c.decode_step_s == pytest.approx(0.01, rel=0.1)


# ---------------------------------------------------------------- explainability, counters, fallback
def test_recent_decisions_and_counters():
    core, _ = make(recent_decisions=3)
    hold(core, "a", PREFIX)
    ds = [core.route(req(f"r{i}"), ["a", "b"]) for i in range(5)]
    assert [d.req_id for d in core.recent_decisions(10)] == ["r2", "r3", "r4"]
    assert core.recent_decisions(1) == [ds[-1]] and core.recent_decisions(0) == []
    core.on_first_token("r0", num_cached_tokens=1024)
    core.on_actual_cached("r1", 512)
    c = core.counters()
    assert c.num_decisions == 5 and c.num_by_reason[Reason.AFFINITY] == 5
    assert (c.predicted_cached_tokens, c.actual_cached_tokens, c.num_accuracy_samples) == (2048, 1536, 2)
    assert c.index_accuracy == pytest.approx(0.75)
    assert c.num_index_entries == len(PREFIX)          # confirmed hashes; speculative holds are apart
    assert core.index.num_spec_entries > 0
    assert all(d.decision_time_s > 0 for d in ds)


def test_an_internal_error_falls_back_to_load_only_and_logs(monkeypatch, caplog):
    core, _ = make()
    stats(core, "a", num_queued_prefill_tokens=9000)

    def boom(*a, **k):
        raise RuntimeError("policy bug")

    monkeypatch.setattr(core.policy, "decide", boom)
    with caplog.at_level(logging.ERROR, logger="affinity_serve.app.routing.core"):
        d = core.route(req("r1"), ["a", "b", "c"])
    assert d.reason == Reason.FALLBACK and sorted(d.ranked) == ["a", "b", "c"] and d.ranked[-1] == "a"
    assert d.chosen == d.ranked[0] and core.counters().num_errors == 1
    assert "policy bug" in caplog.text
    monkeypatch.undo()
    d2 = core.route(req("r2", prefix=chain("z", 4)), ["b", "c"])
    assert score(d2, d.chosen).queued_prefill_tokens == 1124        # the fallback's send counts as load


def test_route_never_raises_on_bad_input():
    core, _ = make()
    assert core.route(req("r1"), []).reason == Reason.FALLBACK
    d = core.route(RouteRequest("r2", [], 0), ["a", "new-replica"])
    assert d.chosen in ("a", "new-replica")


def test_membership_changes_drop_state():
    core, _ = make()
    hold(core, "a", PREFIX)
    core.route(req("r1"), ["a"])
    core.set_replicas([ReplicaInfo("b"), ReplicaInfo("c")])
    assert core.counters().num_index_entries == 0
    core.on_first_token("r1")
    core.on_finished("r1")                                              # unknown by now: a no-op
    core.set_replicas([ReplicaInfo("a"), ReplicaInfo("b")])
    assert core.replicas_needing_snapshot() == ["a"]


def test_most_cached_names_the_replicas_holding_most_of_the_prompt_best_first():
    from affinity_serve.app.routing.api import CandidateScores, Decision, Reason
    scores = CandidateScores(["a", "b", "c", "d"], [16, 48, 0, 32], [0.1] * 4, [0] * 4, [0] * 4, [0.0] * 4)
    d = Decision("r", ["b", "d", "a", "c"], "b", Reason.AFFINITY, scores, 0.0)
    assert d.most_cached() == [("b", 48), ("d", 32)]
    assert d.most_cached(3) == [("b", 48), ("d", 32), ("a", 16)]
    assert d.most_cached(9) == [("b", 48), ("d", 32), ("a", 16)]            # none that holds nothing
    assert Decision("r", [], "", Reason.FALLBACK, CandidateScores.empty(), 0.0).most_cached() == []


# ---------------------------------------------------------------- what a kept decision costs the collector
def _walked_references(obj, shared=()) -> int:
    """Object references the cyclic garbage collector follows from `obj` and the containers it reaches
    (what a young collection walks while the decision sits in the recent-decisions ring), `shared` objects
    (walked once for all decisions) left out."""
    import enum
    import gc
    import types
    seen, stack, total = {id(o) for o in shared}, [obj], 0
    while stack:
        o = stack.pop()
        if (id(o) in seen or not gc.is_tracked(o)
                or isinstance(o, (type, types.ModuleType, types.FunctionType, enum.Enum))):
            continue
        seen.add(id(o))
        refs = gc.get_referents(o)
        total += len(refs)
        stack.extend(refs)
    return total


@pytest.mark.parametrize("reason", ["affinity", "new_group"])
def test_a_kept_decision_costs_the_collector_the_same_at_128_replicas_as_at_8(reason):
    """The ring keeps the last `recent_decisions` decisions: a list per candidate column made every young
    collection walk ~1k references per decision at 128 replicas (~150k in all, a 2-3 ms pause landing
    inside a decision). Columns are arrays, the ranking an index array, and the candidate ids one tuple
    shared by consecutive decisions over the same candidates: the walk does not grow with the fleet."""
    walked = {}
    for n in (8, 128):
        ids = [f"r{i}" for i in range(n)]
        core, _ = make(replicas=[(r, f"n{i // 8}") for i, r in enumerate(ids)])
        if reason == "affinity":
            hold(core, "r3", PREFIX)
        first = core.route(req("p", prefix=chain("other", 4)), ids)
        d = core.route(req("q", prefix=PREFIX if reason == "affinity" else chain("new", 4)), ids)
        assert d.reason.value == reason and len(d.ranked) == n and d.ranked[0] == d.chosen
        assert sorted(d.ranked) == sorted(ids) and len(d.candidates) == n
        assert d.scores.replica_ids is first.scores.replica_ids
        other = make(replicas=[("x", "n0"), ("y", "n0")])[0].route(req("o"), ["x", "y"])     # another router
        assert core.route(req("q2"), ids).scores.replica_ids is first.scores.replica_ids
        assert other.scores.replica_ids == ("x", "y")
        walked[n] = _walked_references(d, shared=[d.scores.replica_ids])
    assert walked[128] <= walked[8] + 4, walked


def test_short_prompts_on_an_idle_replica_do_not_teach_a_slow_prefill_rate():
    """An idle replica answers a 4-token prompt in ~10 ms of fixed overhead: read as a per-token rate that is
    400 tokens/s, and admission then refused long prompts on an idle server, for good (acceptance finding).
    Such samples are skipped; a prompt long enough for its prefill to dominate still calibrates."""
    core, clock = make(calibrate=True)
    for i in range(5):
        r = RouteRequest(f"tiny{i}", [], 4, 8)
        core.route(r, ["a"])
        clock.t += 0.010
        core.on_first_token(r.req_id, num_cached_tokens=0)
        core.on_finished(r.req_id)
    assert core.counters().prefill_tokens_per_s == pytest.approx(core.model.rate0)
    for i in range(40):                                      # 2k-token prompts at 4000 tokens/s
        r = req(f"long{i}", prefix=chain(f"l{i}", 4), extra_blocks=120)
        core.route(r, ["a"])
        clock.t += r.num_prompt_tokens / 4000.0
        core.on_first_token(r.req_id, num_cached_tokens=0)
        core.on_finished(r.req_id)
    assert core.counters().prefill_tokens_per_s == pytest.approx(4000, rel=0.1)
