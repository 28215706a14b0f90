"""The cluster-level node-store benchmark (benchmarks/routing/tiers.py) runs the engine's real
SharedConnectorScheduler over its simulated store, so a change to the store surface that connector reads
breaks it: it crashed on `store.generation` and `store.check_dir` until its NodeStore grew them. A small run
end to end, with what the store must do there."""
from __future__ import annotations

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
