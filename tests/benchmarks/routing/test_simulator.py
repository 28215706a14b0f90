"""The routing simulator: every request finishes and no KV block stays held; the shared-cache bound is an
upper bound for every router; the shared-cache oracle really shares."""
from __future__ import annotations

import pytest

from benchmarks.routing.replica import ReplicaSpec, SimReplica, TimingModel
from benchmarks.routing.simulator import Simulation, default_routers, make_router, prepare
from benchmarks.routing.routers import TokenText
from affinity_serve.engine.hashing import hash_block_chain


@pytest.fixture(scope="module")
def runs(small_trace):
    prepared = prepare(small_trace)
    text = TokenText(small_trace.meta.spec.vocab_size)
    out = []
    for name in default_routers():
        sim = Simulation(prepared, make_router(name, prepared, text))
        out.append((sim, sim.run()))
    return prepared, out


def test_every_request_finishes_and_no_blocks_stay_held(runs):
    prepared, out = runs
    n = len(prepared.trace.requests)
    for sim, res in out:
        assert res.num_requests == n
        for rep in sim.replicas:
            assert not rep.has_work and rep.num_held_blocks() == 0, (res.router, rep.index)
            assert rep.kv.req_to_blocks == {}
        assert sum(res.requests_per_replica) == res.num_measured
        assert 0 < res.ttft_p50_s <= res.ttft_p99_s < res.e2e_mean_s * 50


def test_shared_cache_bound_is_an_upper_bound(runs):
    prepared, out = runs
    assert prepared.shared_bound >= prepared.pinned_bound
    for _, res in out:
        assert res.hit_rate <= prepared.shared_bound + 1e-9, res.router
    names = {res.router for _, res in out}
    assert "round-robin" in names and any(n.startswith("ray") for n in names)


def test_prefix_routers_beat_round_robin(runs):
    _, out = runs
    hit = {res.router: res.hit_rate for _, res in out}
    assert hit["oracle: shared cache"] > hit["round-robin"]
    assert hit["ray prefix-aware, imbalance inf (default)"] > hit["round-robin"]


def test_shared_cache_oracle_hits_blocks_another_replica_computed():
    spec = ReplicaSpec()
    shared: set = set()
    a, b = (SimReplica(i, spec, TimingModel(), shared_cache=shared) for i in range(2))
    prompt = list(range(100, 100 + 640))
    hashes = hash_block_chain(prompt, spec.block_size)
    for rep, rid in ((a, "x"), (b, "y")):
        rep.add_request(rid, prompt, [5, 6], hashes)
        cached = None
        while rep.has_work:
            assert rep.start_step() is not None
            res = rep.end_step()
            cached = res.num_cached_tokens.get(rid, cached)
        assert rep.num_held_blocks() == 0
    assert cached == 624        # b found all 39 full blocks below the last token that a computed
