"""The llm-d-style comparison policy (routing.policy: llm_d_precise): sticky to the holder of >= 80% of the
prompt until its TTFT estimate is more than the penalty above the best other, token load otherwise."""
from __future__ import annotations

import random

from affinity_serve.app.routing import AffinityConfig, KVEventBatch, ReplicaInfo, RouteRequest, make_core
from affinity_serve.app.routing.api import Reason
from affinity_serve.app.routing.baselines import LlmdPreciseCore

from .helpers import BS, Clock, chain, stored


def make(penalty_s: float = 18.0):
    clock = Clock()
    core = LlmdPreciseCore(AffinityConfig(prefill_tokens_per_s=10_000.0), BS, clock=clock, rng=random.Random(0),
                           max_ttft_penalty_s=penalty_s)
    core.set_replicas([ReplicaInfo(r) for r in "abc"])
    for r in "abc":
        assert core.on_kv_events(KVEventBatch(r, "e0", 0, []))
    return core, clock


def test_make_core_builds_it_and_it_follows_kv_events():
    core = make_core("llm_d_precise", AffinityConfig(), BS)
    assert isinstance(core, LlmdPreciseCore)
    core.set_replicas([ReplicaInfo("a")])
    assert core.replicas_needing_snapshot() == ["a"]


def test_sticky_to_the_holder_until_the_penalty_then_token_load():
    core, clock = make(penalty_s=1.0)
    prefix = chain("sys", 90)
    core.on_kv_events(KVEventBatch("a", "e0", 0, [stored(prefix)]))
    chosen = []
    for i in range(12):                      # each adds ~164 uncached tokens of in-flight load on a
        clock.t += 0.001
        d = core.route(RouteRequest(f"r{i}", prefix + chain(f"u{i}", 10), 100 * BS, 16), list("abc"))
        chosen.append((d.chosen, d.reason))
    assert all(c == ("a", Reason.AFFINITY) for c in chosen)
    # a cold prompt goes by token load: not to a (it has in-flight tokens), never the filter
    d = core.route(RouteRequest("cold", chain("other", 20), 20 * BS, 16), list("abc"))
    assert d.chosen in ("b", "c") and d.reason == Reason.LOAD
    # a's in-flight tokens past the penalty (1 s = 10k tokens): the filter is dropped
    for i in range(12):
        core.route(RouteRequest(f"big{i}", prefix + chain(f"v{i}", 60), 150 * BS, 16), ["a"])
    d = core.route(RouteRequest("late", prefix + chain("w", 10), 100 * BS, 16), list("abc"))
    assert d.reason == Reason.LOAD and d.chosen in ("b", "c")
    # first tokens retire the in-flight tokens: sticky again, to a or to `late`'s replica (speculatively warm)
    for i in range(12):
        core.on_first_token(f"big{i}", 0)
        core.on_finished(f"big{i}", 16)
    d2 = core.route(RouteRequest("again", prefix + chain("x", 10), 100 * BS, 16), list("abc"))
    assert d2.reason == Reason.AFFINITY and d2.chosen in ("a", d.chosen)


def test_its_counters_report_its_index_and_its_predictions():
    """routing_decisions showed num_index_entries 0 and index_accuracy inf under llm_d_precise: the load-only
    base class reported neither, although this policy indexes and predicts."""
    core, clock = make()
    prefix = chain("sys", 20)
    core.on_kv_events(KVEventBatch("a", "e0", 0, [stored(prefix)]))
    d = core.route(RouteRequest("r", prefix + chain("u", 2), 22 * BS, 4), list("abc"))
    assert d.chosen == "a"
    core.on_first_token("r", 20 * BS)
    c = core.counters()
    assert c.num_index_entries >= 20 and c.predicted_cached_tokens > 0
    assert c.index_accuracy == c.actual_cached_tokens / c.predicted_cached_tokens
    rr = make_core("round_robin", AffinityConfig(), BS)
    rr.set_replicas([ReplicaInfo("a")])
    rr.route(RouteRequest("q", [], 8 * BS, 4), ["a"])
    rr.on_first_token("q", 8)
    assert rr.counters().predicted_cached_tokens == 0 and rr.counters().num_index_entries == 0
