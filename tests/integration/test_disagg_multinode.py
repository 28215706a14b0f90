"""P/D node preference on a simulated multi-node cluster (ray.cluster_utils.Cluster on 127.0.0.1): 1 prefill
replica on node A, decode replicas on A and B, 2 ingress replicas. Every request long enough for the prefill pool
is decoded on A, next to its prefill replica, whichever ingress replica routed it (each has its own routers over
both pools), and its greedy tokens equal one unified engine's.

The scenario runs in a subprocess (tests/integration/disagg_multinode_scenario.py): one process can join only
one Ray cluster, and this test process may already hold the session Ray of tests/integration/conftest.py."""
from __future__ import annotations

import json

import pytest

from tests.integration.subprocess_scenario import run_scenario

pytestmark = pytest.mark.slow
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    res = run_scenario("tests.integration.disagg_multinode_scenario", tmp_path_factory.mktemp("pd-multinode"),
                       TIMEOUT_S)
    before = res["pd_counters_before"]
    print(json.dumps({"warmup": res["warmup"], "requests": len(res["requests"]), "per_ingress": {
        i: {k: v - before.get(i, {}).get(k, 0) for k, v in c.items()} for i, c in res["pd_counters"].items()}}))
    return res


def test_the_pools_are_placed_on_the_nodes_their_resources_name(result):
    nodes, p = result["nodes"], result["placement"]
    assert list(p["PrefillReplica"].values()) == [nodes["a"]]
    assert sorted(p["LLMReplica"].values()) == sorted([nodes["a"], nodes["b"]])
    assert list(p["Ingress"].values()) == [nodes["head"]] * 2


def test_each_request_is_decoded_on_its_prefill_replicas_node_and_equals_unified(result):
    """By chance (two idle decode replicas) half the requests would cross nodes."""
    nodes, p = result["nodes"], result["placement"]
    on_a = [rid for rid, node in p["LLMReplica"].items() if node == nodes["a"]]
    reqs = result["requests"]
    assert [r["status"] for r in reqs] == [200] * len(reqs), reqs
    assert {r["replica"] for r in reqs} == set(on_a), (reqs, result["pd_counters"])
    for r in reqs:
        assert r["token_ids"] == r["unified"]
    assert result["kv_reads"] >= len(reqs)        # the KV came from the prefill replica, through Ray


def test_each_ingress_replica_picks_the_prefill_replica_and_a_decode_replica_on_its_node(result):
    """Both ingress replicas routed requests (the scenario sends more until each has routed 2), each picked
    the prefill replica itself and put every request on the prefill replica's node."""
    before, after = result["pd_counters_before"], result["pd_counters"]
    assert len(after) == 2 and set(before) == set(after), (before, after)
    picked = {i: c["prefill_picked"] - before[i].get("prefill_picked", 0) for i, c in after.items()}
    assert sum(picked.values()) == len(result["requests"]) and min(picked.values()) >= 2, picked
    for i, c in after.items():
        assert c["same_node"] - before[i].get("same_node", 0) == picked[i], (i, before[i], c)
        assert c["other_node"] == before[i].get("other_node", 0), (i, before[i], c)
