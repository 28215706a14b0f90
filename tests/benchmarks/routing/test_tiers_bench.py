"""The cluster-level node-store benchmark (benchmarks/routing/tiers.py) runs the engine's real
SharedConnectorScheduler over its simulated store, so a change to the store surface that connector reads
breaks it: it crashed on `store.generation` and `store.check_dir` until its NodeStore grew them. A small run
end to end, with what the store must do there."""
from __future__ import annotations

import pytest

from benchmarks.routing.tiers import NodeStore, StoreSpec, run_config, table
from benchmarks.routing.workload import WorkloadSpec


def test_the_store_run_loads_prefixes_from_the_node_store_and_the_table_compares_it():
    spec = WorkloadSpec(num_replicas=4, pressure=0.75, load=1.0, requests_per_replica=60, seed=1)
    doc = run_config(spec, StoreSpec(replicas_per_node=2, capacity_x=2.0), lambda msg: None)
    rows = {r["router"]: r for r in doc["rows"]}
    assert set(rows) == {"ours, no store", "ours + node store", "power-of-two + node store",
                         "shared infinite cache (oracle)"}
    for name in ("ours + node store", "power-of-two + node store"):
        r = rows[name]
        assert r["num_measured"] == rows["ours, no store"]["num_measured"] > 0
        # prefixes another replica of the node computed come from the store, not from a recompute
        assert r["loaded_tokens_share"] > 0.0, name
        # a block evicted between lookup and load fails that load and the request recomputes: rare, not fatal
        assert r["failed_loads"] <= 2, name
    # power-of-two spreads a group over the node, so its siblings load what one of them stored
    assert rows["power-of-two + node store"]["loaded_tokens_share"] > rows["ours + node store"]["loaded_tokens_share"]
    # a hit in the pool or the store is counted: the store can only add to what ours hits without it
    assert rows["ours + node store"]["hit_rate"] >= rows["ours, no store"]["hit_rate"]
    assert rows["ours + node store"]["hit_rate"] <= doc["shared_bound"] + 1e-9
    text = table([doc])
    assert "ours + node store" in text and "4 × ρ 0.75, load 1.0" in text


def test_the_node_store_keeps_the_most_recent_blocks_down_to_its_low_water_mark():
    store = NodeStore(capacity_blocks=10)
    written, evicted = store.write_many([bytes([i]) for i in range(10)])
    assert len(written) == 10 and evicted == []
    assert store.read(bytes([0]))                          # block 0 is now the most recent
    written, evicted = store.write_many([bytes([10])])
    assert written == [bytes([10])]
    assert evicted == [bytes([1]), bytes([2])]             # down to 9 blocks: the least recent went
    assert store.contains(bytes([0])) and not store.contains(bytes([1]))
    assert store.generation == 0
    store.check_dir()                                      # nothing to reopen: a no-op the connector calls


def _request(n_tokens: int, block_size: int = 16):
    from affinity_serve.engine.hashing import hash_block_chain
    from benchmarks.routing.routers import SimRequest
    ids = list(range(1, n_tokens + 1))
    return SimRequest("r1", ids, hash_block_chain(ids, block_size), 16, "g")


def _stored(rid: str, hashes, medium: str, block_size: int = 16):
    from affinity_serve.app.routing.api import KVEventBatch
    from affinity_serve.engine.types import BlockStored
    return KVEventBatch(rid, "e", 0, [BlockStored(list(hashes), None, [], block_size, medium)])


def test_tier_aware_llmd_credits_its_nodes_store_in_the_affinity_score_and_the_token_load():
    from affinity_serve.engine.types import MEDIUM_POOL, MEDIUM_SHARED
    from benchmarks.routing.field import LlmdPrecise, LlmdTiered
    from benchmarks.routing.replica import ReplicaSpec
    from benchmarks.routing.routers import ClusterView
    spec = ReplicaSpec(num_kv_tokens=4096)
    req = _request(160)                     # 10 full blocks; the engine never serves the last token from cache: 9
    assert len(req.block_hashes) == 10
    tiered = LlmdTiered(spec, 20_000.0, replicas_per_node=2)      # replicas 0-1 on node 0, 2-3 on node 1
    plain = LlmdPrecise(spec, 20_000.0)
    for r in (tiered, plain):
        r.setup(ClusterView(4), seed=0)
        r.in_flight_uncached = [0, 100, 500, 50]
        r.index.apply_events(_stored(r.ids[2], req.block_hashes[:5], MEDIUM_POOL))     # half in replica 2's pool
        # node 1's store holds the whole prompt: stored by replica 3, loadable by both replicas of the node
        r.index.apply_events(_stored(r.ids[3], req.block_hashes, MEDIUM_SHARED))
    # replica 2: 5 pool blocks + 0.75 x 4 store blocks (capped at 9) = 8 >= 0.8 x 10: warm, the only one
    # (replica 3: 0.75 x 9 < 8), so it wins though replicas 0 and 3 carry less token load
    assert tiered.route(req, 0.0) == 2
    # what it will prefill: the last block only (9 blocks pool + store); the 4 from the store are loaded
    assert tiered.prompt_blocks["r1"] == (2, 0, 16)
    # the plain scorer reads pools only: 5 / 10 is not warm, so the least token load with the whole prompt wins
    assert plain.route(req, 0.0) == 0 and plain.prompt_blocks["r1"] == (0, 0, 160)


def test_the_fleet_mode_runs_llmd_and_ours_with_and_without_the_store_on_one_trace():
    from benchmarks.routing.tiers import FLEET_RUNS, fleet_table, run_fleet_cell
    doc = run_fleet_cell(5, 0, StoreSpec(), lambda msg: None, requests_per_replica=40)
    rows = {r["router"]: r for r in doc["rows"]}
    assert list(rows) == [label for label, _, _ in FLEET_RUNS]
    kinds = {"llmd": "LlmdPrecise", "llmd-tiered": "LlmdTiered", "ours": "OursWithNodes"}
    for label, with_store, kind in FLEET_RUNS:
        assert rows[label]["router_class"] == kinds[kind], label
        assert rows[label]["events_period_s"] == 0.5, label                # the cell's feed period, not 0.25
        assert ("loaded_tokens_share" in rows[label]) == with_store, label
        assert rows[label]["num_measured"] > 0
    assert rows["ours + node store"]["hit_rate"] >= rows["ours"]["hit_rate"]
    text = fleet_table([doc])
    assert "8 × ρ 0.75, load 1.0 | 0 |" in text and "geometric mean | 1 traces" in text


@pytest.mark.parametrize("argv, says", [
    (["--fleet", "0"], "the fleet suite's cells are 1-"),       # FLEET[-1] would have run the last cell
    (["--fleet", "99"], "the fleet suite's cells are 1-"),
    (["--fleet", "5", "--seeds", "x"], "--fleet takes cell numbers"),
    (["--fleet", "5", "--png", "out.png"], "--png draws the default runs only"),
])
def test_bad_fleet_flags_are_one_line_naming_the_flag(argv, says, monkeypatch, capsys):
    from benchmarks.routing import tiers
    monkeypatch.setattr("sys.argv", ["tiers.py", *argv])
    with pytest.raises(SystemExit) as e:
        tiers.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "".join(err)


def test_a_fleet_cell_out_of_range_is_a_value_error_naming_the_range():
    from benchmarks.routing.tiers import run_fleet_cell
    with pytest.raises(ValueError, match="cells are 1-"):
        run_fleet_cell(0, 0, StoreSpec(), lambda msg: None)
