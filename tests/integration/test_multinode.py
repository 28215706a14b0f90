"""Placement and node failure on a simulated 3-node cluster (ray.cluster_utils.Cluster on 127.0.0.1).

The scenario (tests/integration/multinode_scenario.py) runs in a subprocess, on the cluster it shares with
test_disagg_multinode.py's (the `multinode_results` fixture): one process can join only one Ray cluster, and
this test process may already hold the session Ray of tests/integration/conftest.py."""
from __future__ import annotations

from collections import Counter

import pytest

# the first test's setup waits for the background scenario (conftest.py's `multinode_results`: up to 600 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


@pytest.fixture(scope="module")
def result(multinode_results):
    return multinode_results["multinode"]


def test_replicas_spread_one_per_node_and_the_control_plane_stays_on_the_head(result):
    head, workers = result["nodes"]["head"], result["nodes"]["workers"]
    p = result["placement"]
    assert sorted(p["replicas"].values()) == sorted([head, *workers])        # max_replicas_per_node: 1
    assert p["ingress"] == [head] and p["controller"] == [head] and p["proxies"] == [head]


def test_equally_good_replicas_prefer_the_callers_node(result):
    """Distinct prompts, idle replicas with room to spare: the router (in the ingress, on the head) picks
    the replica on its own node; by chance it would be one in three."""
    head = result["nodes"]["head"]
    local = [r for r, node in result["placement"]["replicas"].items() if node == head]
    b = result["caller_node"]
    assert b["router_node"] == head and set(b["statuses"]) == {200}
    counts = Counter(b["served"])
    assert counts[local[0]] >= 11, (counts, b["decisions"])


def test_a_removed_nodes_streams_fail_fast_and_cleanly_and_the_others_finish(result):
    r = result["removal"]
    victims = [s for s in r["streams"] if s["on_victim"]]
    others = [s for s in r["streams"] if not s["on_victim"]]
    assert victims and others
    for s in victims:   # an SSE error event in the OpenAI envelope, then [DONE]: no reset, no hang
        assert s["failure"] is None and s["done"] and s["error_code"] == "replica_unavailable", s
        assert s["ended_after_removal_s"] < 15, s
    for s in others:
        assert s["failure"] is None and s["done"] and s["error_code"] is None, s
        assert s["finish_reason"] == "length", s
    assert r["after_statuses"] == [200] * 6, (r["after_served"], result["timings_s"])
    assert not set(r["after_served"]) & set(r["victim_replicas"])


def test_the_router_drops_the_dead_replica_and_the_replacement_waits_for_a_node(result):
    victim_node, victims = result["removal"]["victim_node"], result["removal"]["victim_replicas"]
    assert result["timings_s"]["router_dropped_dead"] < 30
    # two nodes left and at most one replica per node: the replacement cannot start
    assert result["states_with_two_nodes"].get("RUNNING") == 2
    two = result["placement_with_two_nodes"]
    assert len(set(two.values())) == 2 and victim_node not in two.values()
    rec = result["recovered"]
    assert sorted(rec["router_replicas"]) == sorted(rec["placement"])
    assert not set(victims) & set(rec["placement"])
    new = [rid for rid, node in rec["placement"].items() if rid not in two]
    assert len(new) == 1 and rec["placement"][new[0]] == rec["new_node"]
    assert rec["statuses"] == [200] * 6
