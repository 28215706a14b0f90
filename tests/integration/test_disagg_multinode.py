"""P/D node preference on a simulated multi-node cluster (ray.cluster_utils.Cluster on 127.0.0.1): 1 prefill
replica on node A, decode replicas on A and B. Every request long enough for the prefill pool is decoded on A,
next to its prefill replica, and its greedy tokens equal one unified engine's.

The scenario runs in a subprocess (tests/integration/disagg_multinode_scenario.py): one process can join only
one Ray cluster, and this test process may already hold the session Ray of tests/integration/conftest.py."""
from __future__ import annotations


import pytest

from tests.integration.subprocess_scenario import run_scenario

pytestmark = pytest.mark.slow
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_scenario("tests.integration.disagg_multinode_scenario", tmp_path_factory.mktemp("pd-multinode"),
                        TIMEOUT_S)


def test_the_pools_are_placed_on_the_nodes_their_resources_name(result):
    nodes, p = result["nodes"], result["placement"]
    assert list(p["PrefillReplica"].values()) == [nodes["a"]]
    assert sorted(p["LLMReplica"].values()) == sorted([nodes["a"], nodes["b"]])
    assert list(p["Ingress"].values()) == [nodes["head"]]


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
    before, after = result["pd_counters_before"], result["pd_counters"]
    assert after["prefill_picked"] - before["prefill_picked"] == len(reqs)
    assert after["same_node"] - before["same_node"] == len(reqs) and after["other_node"] == before["other_node"]
