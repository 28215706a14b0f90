"""The engine's own measure of the wait for KV blocks, in the router (issue 25: the short-prompt suite's small
pools, where ours' TTFT tail was 1.38x llm-d's). Two uses:

- calibration (`kv_wait_calibration`, on): a request's TTFT less the time it waited in its engine's queue for
  KV blocks (`RequestDelta.kv_wait_s`, reported with the first token) is what the prefill-rate fit learns
  from. With the wait in, a KV-bound backlog read as slow prefill: the simulated 20,000 tokens/s device was
  learned as 10,834 tokens/s;
- routing (`measured_kv_wait_weight`): each replica's stats carry the wait a request joining its queue can
  expect (`SchedulerStats.kv_wait_s`: while the queue is blocked for blocks, the recent admissions' waits), and
  the routing TTFT adds weight x that.
"""
from __future__ import annotations

import random

import pytest

from affinity_serve.app.protocol import ReplicaChunk
from affinity_serve.app.routing import AffinityConfig, PrefixAffinityRouterCore, ReplicaInfo, ReplicaLoadView
from affinity_serve.app.stats import routing_stats
from affinity_serve.engine.types import RequestDelta
from tests.unit.routing.helpers import Clock
from tests.unit.routing.test_core import chain, req, stats

RATE = 4000.0


def _core(**cfg) -> tuple[PrefixAffinityRouterCore, Clock]:
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(decode_step_s=0.002, **cfg), 16, clock=clock,
                                    rng=random.Random(0))
    core.set_replicas([ReplicaInfo("a"), ReplicaInfo("b")])
    return core, clock


def _drive(core, clock, *, kv_wait_s: float, n: int = 300) -> None:
    """n requests on "a" whose TTFT is their prefill at RATE plus, on every other one, `kv_wait_s` waited for
    KV blocks, reported with the first token."""
    rng = random.Random(3)
    for i in range(n):
        q = rng.randrange(0, 20_000)
        stats(core, "a", num_queued_prefill_tokens=q, num_running=0)
        r = req(f"r{i}", prefix=chain(f"c{i}", 4), extra_blocks=rng.randrange(1, 100))
        core.route(r, ["a"])
        wait = kv_wait_s if i % 2 else 0.0
        clock.t += (q + r.num_prompt_tokens) / RATE + wait
        core.on_first_token(r.req_id, num_cached_tokens=0, kv_wait_s=wait)
        core.on_finished(r.req_id)


def test_the_prefill_rate_is_learned_without_the_time_spent_waiting_for_kv_blocks():
    core, clock = _core()
    _drive(core, clock, kv_wait_s=2.0)
    assert core.counters().prefill_tokens_per_s == pytest.approx(RATE, rel=0.05)


def test_without_it_a_kv_bound_queue_reads_as_slow_prefill():
    core, clock = _core(kv_wait_calibration=False)
    _drive(core, clock, kv_wait_s=2.0)
    assert core.counters().prefill_tokens_per_s < 0.85 * RATE      # 22% slow: every other TTFT has 2 s more


def test_a_negative_wait_is_ignored_not_added_to_the_ttft():
    rates = []
    for wait in (-5.0, None):
        core, clock = _core()
        stats(core, "a", num_queued_prefill_tokens=0, num_running=0)
        core.route(req("x", prefix=chain("x", 4), extra_blocks=60), ["a"])
        clock.t += 1.0
        core.on_first_token("x", num_cached_tokens=0, kv_wait_s=wait)
        assert core.model.num_samples == 1
        rates.append(core.model.prefill_tokens_per_s)
    assert rates[0] == rates[1]          # learned from the 1 s TTFT as it was, not from 6 s


def test_a_wait_longer_than_the_ttft_teaches_nothing_negative():
    core, clock = _core()
    core.route(req("x"), ["a"])
    clock.t += 0.5
    core.on_first_token("x", num_cached_tokens=0, kv_wait_s=3.0)      # clocks apart: the wait is capped at the TTFT
    assert core.model.num_samples == 0 and core.model.prefill_tokens_per_s == core.model.rate0


def test_a_replica_whose_queue_waits_for_kv_loses_the_request_with_the_weight_on():
    """Two replicas equal but for the wait their engines report: with the weight the request goes to the one
    whose queue is not blocked; without it, the wait is invisible (both look equally idle)."""
    for weight, expect in ((0.0, None), (3.0, "b")):
        core, _ = _core(calibrate=False, measured_kv_wait_weight=weight)
        core.on_stats("a", ReplicaLoadView(num_running=4, kv_cache_usage=0.97, num_blocks=1024, kv_wait_s=0.4))
        core.on_stats("b", ReplicaLoadView(num_running=4, kv_cache_usage=0.97, num_blocks=1024))
        d = core.route(req("r1", prefix=chain("fresh", 4)), ["a", "b"])
        ttft = {s.replica_id: s.predicted_ttft_s for s in d.scores}
        assert ttft["a"] - ttft["b"] == pytest.approx(weight * 0.4, abs=1e-9)
        if expect:
            assert d.chosen == expect


def _holder_race(wait_a: float, b_view: ReplicaLoadView) -> str:
    """"a" holds the request's 16-block prefix (256 cached tokens: 64 ms of prefill at RATE) and reports a
    KV wait of `wait_a`; "b" holds nothing. Weight 1, no release slack: where does the request go?"""
    from tests.unit.routing.test_core import hold
    core, _ = _core(calibrate=False, prefill_tokens_per_s=RATE, measured_kv_wait_weight=1.0,
                    release_slack=0.0, release_slack_abs_s=0.0)
    prefix = chain("p", 16)
    hold(core, "a", prefix)
    core.on_stats("a", ReplicaLoadView(kv_cache_usage=0.5, num_blocks=1024, kv_wait_s=wait_a))
    core.on_stats("b", b_view)
    return core.route(req("r1", prefix=prefix), ["a", "b"]).chosen


def test_a_holders_measured_wait_releases_the_request_to_a_replica_with_room_when_it_costs_more_than_the_prefix():
    roomy = ReplicaLoadView(kv_cache_usage=0.5, num_blocks=1024)
    assert _holder_race(0.01, roomy) == "a"          # 10 ms of wait against 64 ms of recompute: stay
    assert _holder_race(0.5, roomy) == "b"           # half a second: move to the pool with room


def test_a_holders_measured_wait_never_releases_the_request_to_a_pool_short_of_blocks_too():
    """Under a fleet-wide KV overload every queue waits: a move would only add the prefix's blocks to another
    short pool (on one short-prompt trace such moves took the hit rate to 0.85 of the bound)."""
    blocked = ReplicaLoadView(kv_cache_usage=0.5, num_blocks=1024, kv_wait_s=0.05)
    assert _holder_race(0.5, blocked) == "a"
    full = ReplicaLoadView(num_running=30, num_waiting=20, kv_cache_usage=1.0, num_queued_prefill_tokens=20_000,
                           num_blocks=1024)          # no wait measured yet, but its queue does not fit its pool
    assert _holder_race(0.5, full) == "a"


def test_the_stats_carry_the_engines_wait_and_the_router_reads_it():
    from affinity_serve.engine.types import EngineLoad
    load = EngineLoad(num_running_reqs=3, num_waiting_reqs=5, kv_cache_usage=0.99, num_queued_prefill_tokens=900,
                      num_free_blocks=0, num_blocks=64, num_requests=8, prefix_cache_queries_total=0,
                      prefix_cache_hits_total=0, recent_prefix_cache_queries=0, recent_prefix_cache_hits=0,
                      num_preemptions_total=0, cache_epoch="e:0", timestamp=0.0, kv_wait_s=0.123456)
    s = routing_stats(load)
    assert s["kv_wait_s"] == 0.1235
    assert ReplicaLoadView.from_stats(s).kv_wait_s == pytest.approx(0.1235)
    assert ReplicaLoadView.from_stats({"num_running_reqs": 1}).kv_wait_s == 0.0     # an older replica: none


def test_a_replica_chunk_keeps_the_deltas_wait_and_its_own_id():
    d = RequestDelta("q", 0, "", [5], num_prompt_tokens=10, num_cached_tokens=4, kv_wait_s=0.25)
    c = ReplicaChunk.of(d, "replica-7")
    assert (c.replica_id, c.kv_wait_s, c.num_cached_tokens) == ("replica-7", 0.25, 4)
