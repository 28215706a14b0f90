"""P/D node preference on a simulated multi-node cluster (ray.cluster_utils.Cluster on 127.0.0.1): 1 prefill
replica on node A, decode replicas on A and B, 2 ingress replicas. Every request long enough for the prefill pool
is decoded on A, next to its prefill replica, whichever ingress replica routed it (each has its own routers over
both pools), under prefix_affinity and under the load-only power_of_two (which compares ongoing requests), and
its greedy tokens equal one unified engine's.

The scenario (tests/integration/disagg_multinode_scenario.py) runs in a subprocess, on the cluster it shares with
test_multinode.py's (the `multinode_results` fixture): one process can join only one Ray cluster, and this test
process may already hold the session Ray of tests/integration/conftest.py."""
from __future__ import annotations

import json

import pytest

# the first test's setup waits for the background scenario (conftest.py's `multinode_results`: up to 600 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]
POLICIES = ("prefix_affinity", "power_of_two")


def _picked(phase: dict, key: str = "prefill_picked") -> dict[str, int]:
    """Per ingress replica: how much `key` grew over the phase's measured requests."""
    before = phase["pd_counters_before"]
    return {i: c.get(key, 0) - before.get(i, {}).get(key, 0) for i, c in phase["pd_counters"].items()}


@pytest.fixture(scope="module")
def result(multinode_results):
    res = multinode_results["disagg"]
    print(json.dumps({name: {"warmup": ph["warmup"], "requests": len(ph["requests"]), "per_ingress": {
        k: _picked(ph, k) for k in ("prefill_picked", "same_node", "moved_to_prefill_node", "other_node")}}
        for name, ph in res["phases"].items()}))
    return res


@pytest.mark.parametrize("policy", POLICIES)
def test_the_pools_are_placed_on_the_nodes_their_resources_name(result, policy):
    nodes, p = result["nodes"], result["phases"][policy]["placement"]
    assert list(p["PrefillReplica"].values()) == [nodes["a"]]
    assert sorted(p["LLMReplica"].values()) == sorted([nodes["a"], nodes["b"]])
    assert list(p["Ingress"].values()) == [nodes["head"]] * 2


@pytest.mark.parametrize("policy", POLICIES)
def test_each_request_is_decoded_on_its_prefill_replicas_node_and_equals_unified(result, policy):
    """By chance (two idle decode replicas) half the requests would cross nodes."""
    nodes, phase = result["nodes"], result["phases"][policy]
    on_a = [rid for rid, node in phase["placement"]["LLMReplica"].items() if node == nodes["a"]]
    reqs = phase["requests"]
    assert [r["status"] for r in reqs] == [200] * len(reqs), reqs
    assert {r["replica"] for r in reqs} == set(on_a), (reqs, phase["pd_counters"])
    for r in reqs:
        assert r["token_ids"] == r["unified"]
    assert phase["kv_reads"] >= len(reqs)        # the KV came from the prefill replica, through Ray


@pytest.mark.parametrize("policy", POLICIES)
def test_each_ingress_replica_picks_the_prefill_replica_and_a_decode_replica_on_its_node(result, policy):
    """Both ingress replicas routed requests (the scenario sends more until each has routed some), each picked
    the prefill replica itself and put every request on the prefill replica's node."""
    phase = result["phases"][policy]
    assert len(phase["pd_counters"]) == 2 and set(phase["pd_counters_before"]) == set(phase["pd_counters"])
    picked = _picked(phase)
    assert sum(picked.values()) == len(phase["requests"]) and min(picked.values()) >= 1, picked
    assert _picked(phase, "same_node") == picked, phase
    assert set(_picked(phase, "other_node").values()) == {0}, phase
