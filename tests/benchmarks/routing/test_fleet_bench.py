"""The fleet suite's parts: long-tail lengths, the TTFT floor no router beats, the field's baselines (llm-d's
sticky precise scorer, SGLang's cache_aware, Dynamo's cost) behaving as their descriptions say, and the
targets read against the best baseline."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks.routing import report
from benchmarks.routing.field import DynamoKV, LlmdPrecise, SglangCacheAware
from benchmarks.routing.replica import ReplicaSpec
from benchmarks.routing.routers import ClusterView, SimRequest, TokenText
from benchmarks.routing.simulator import Simulation, make_router, prepare
from benchmarks.routing.workload import LONG_TAIL, WorkloadSpec, generate, replica_from_args
from affinity_serve.engine.hashing import hash_block_chain


@pytest.fixture(scope="module")
def long_trace():
    a = argparse.Namespace(kv_blocks=2048, long_tail=True)
    return generate(WorkloadSpec(num_replicas=3, pressure=0.75, load=1.2, requests_per_replica=60, seed=3,
                                 long_tail=True), replica_from_args(a))


def test_long_tail_lengths_reach_past_10k_and_stay_under_the_cap(long_trace):
    lens = [len(r.prompt_token_ids) for r in long_trace.requests]
    assert max(lens) >= 10_000 and max(lens) + 1 <= long_trace.meta.replica.max_model_len
    assert np.percentile(lens, 99) > 4 * np.median(lens)                 # a long tail, not a wider bell
    assert all(len(r.prompt_token_ids) + len(r.output_token_ids) <= LONG_TAIL["MAX_CONTEXT"]
               for r in long_trace.requests if r.component == "B")
    assert long_trace.meta.replica.num_kv_tokens == 2048 * 16


def test_no_router_beats_the_ttft_floor(long_trace):
    prepared = prepare(long_trace)
    floor = np.array(prepared.ttft_floor)
    text = TokenText(long_trace.meta.spec.vocab_size)
    for name in ("ours", "llmd", "sglang", "dynamo", "shared", "power-of-two"):
        sim = Simulation(prepared, make_router(name, prepared, text))
        res = sim.run()
        m = np.array(prepared.measured)
        ttft = (sim.rec.first - sim.rec.release)[m]
        assert np.all(ttft >= floor - 1e-9), name
        assert res.ttft_p99_s >= np.percentile(floor, 99) - 1e-9


def _req(name: str, blocks: int, extra: int = 1) -> SimRequest:
    """A prompt of `blocks` full blocks named `name` plus `extra` tokens (its request id tells them apart)."""
    tokens = [(i * 7919 + len(name) * 31 + ord(name[0])) % 30000 + 3 for i in range(blocks * 16)]
    tokens += list(range(3, 3 + extra))
    return SimRequest(f"{name}+{extra}", tokens, hash_block_chain(tokens, 16), 16, "")


def test_llmd_sticks_to_a_holder_of_80_percent_and_sglang_gates_on_imbalance():
    spec = ReplicaSpec()
    llmd = LlmdPrecise(spec, 20_000.0)
    llmd.setup(ClusterView(4), 0)
    first = _req("p", 40)
    k = llmd.route(first, 0.0)
    # speculative entries make k hold the prompt: the same prefix sticks there whatever its token load
    for i in range(5):
        sib = SimRequest(f"s{i}", first.prompt_token_ids[:-1] + [7 + i], hash_block_chain(
            first.prompt_token_ids[:-1] + [7 + i], 16), 16, "")
        assert llmd.route(sib, 0.01 * i) == k
    sg = SglangCacheAware(spec)
    cluster = ClusterView(3)
    sg.setup(cluster, 0)
    k = sg.route(first, 0.0)
    assert sg.route(_req("p", 40, extra=3), 0.0) == k              # match rate > 0.3: the longest match
    cluster.ongoing[k] = 200                                        # imbalanced (> 64 and > 1.5x): least loaded
    assert sg.route(_req("p", 40, extra=5), 0.0) != k


def test_dynamo_credits_overlap_against_active_blocks():
    dyn = DynamoKV(ReplicaSpec())
    dyn.setup(ClusterView(2), 0)
    a = dyn.route(_req("p", 40), 0.0)
    assert dyn.prefill_blocks[a] == 41 and dyn.decode_blocks[a] == 41
    # the same prompt again: overlap 40 blocks on a, so a costs 41 + 41 - 40 + 41; b costs 41
    assert dyn.route(_req("p", 40, extra=2), 0.0) == 1 - a
    dyn.on_first_token("p+1", a, 0, 0.1)
    assert dyn.prefill_blocks[a] == 0


def test_fleet_targets_compare_with_the_best_baseline():
    def run(name, hit, p99):
        return {"router": name, "hit_rate": hit, "ttft_p99_s": p99, "max_over_mean_load": 1.1,
                "e2e_mean_s": 1.0, "decision_p99_ms": 0.5}
    doc = {"config": {"replicas": 8, "hot_prefix": False, "load_target": 1.5, "long_tail": True},
           "bounds": {"separate_caches_hit_rate": 0.5},
           "results": [run("llm-d precise", 0.49, 1.0), run("dynamo kv router", 0.3, 0.9),
                       run("ours (prefix affinity)", 0.5, 0.7), run("oracle: shared cache", 0.7, 0.1)]}
    targets = report.check_targets(doc)
    ttft = next(t for t in targets if t["target"].startswith("TTFT"))
    assert "dynamo" in ttft["target"] and ttft["bound"] == pytest.approx(0.72) and ttft["met"]
    hit = next(t for t in targets if t["target"].startswith("hit"))
    assert hit["bound"] == pytest.approx(0.485) and hit["met"]


def test_an_ours_variant_overrides_affinity_knobs_and_rejects_unknown_ones(long_trace):
    prepared = prepare(long_trace)
    text = TokenText(long_trace.meta.spec.vocab_size)
    r = make_router("ours:release_cache_weight=1.5:release_slack=0.2", prepared, text)
    assert r.config.release_cache_weight == 1.5 and r.config.release_slack == 0.2
    assert r.name.startswith("ours") and "release_cache_weight=1.5" in r.name
    with pytest.raises(ValueError, match="AffinityConfig field"):
        make_router("ours:no_such_knob=1", prepared, text)


def test_seed_summary_pairs_each_trace_with_its_reference():
    from benchmarks.routing.seeds import summarize

    def doc(seed, ours_hit, ours_p99, ref_p99):
        return {"config": {"replicas": 8, "pressure_target": 0.75, "load_target": 1.5, "events_period_s": 0.5,
                           "seed": seed},
                "results": [{"router": "llm-d precise (sticky)", "hit_vs_separate_bound": 0.96,
                             "ttft_p99_s": ref_p99},
                            {"router": "ours (prefix affinity)", "hit_vs_separate_bound": ours_hit,
                             "ttft_p99_s": ours_p99}]}
    table = summarize([doc(0, 0.98, 0.5, 1.0), doc(1, 0.96, 2.0, 1.0)])
    row = next(line for line in table.splitlines() if "ours" in line)
    # hit: mean 0.97, one seed of two meets 0.97; p99 ratios 0.5 and 2.0: geometric mean 1.0
    assert "0.970 (0.960-0.980)" in row and "1/2" in row and "1.000 (0.50-2.00)" in row


def test_seed_summary_keeps_a_hot_prefix_cell_apart_from_the_mixed_cell_of_the_same_shape():
    from benchmarks.routing.seeds import summarize

    def doc(hot, p99):
        return {"config": {"replicas": 8, "pressure_target": 0.75, "load_target": 1.0, "events_period_s": 0.5,
                           "seed": 0, "hot_prefix": hot},
                "results": [{"router": "llm-d precise (sticky)", "hit_vs_separate_bound": 1.0, "ttft_p99_s": 1.0},
                            {"router": "ours (prefix affinity)", "hit_vs_separate_bound": 1.0, "ttft_p99_s": p99}]}
    rows = [line for line in summarize([doc(False, 0.5), doc(True, 0.25)]).splitlines() if "ours" in line]
    assert len(rows) == 2
    assert any("hot prefix" in r and "0.250" in r for r in rows) and any("ρ 0.75" in r and "0.500" in r for r in rows)


def test_the_tail_decomposition_adds_up_and_names_the_router_reason(long_trace):
    """benchmarks/routing/tail.py: queue + own prefill + interference is each request's TTFT; the queue is
    never negative; own prefill is at least one step; ours' rows carry its decision reasons."""
    from benchmarks.routing import tail
    from benchmarks.routing.replica import TimingModel
    from benchmarks.routing.simulator import FeedPeriods
    prepared = prepare(long_trace)
    text = TokenText(long_trace.meta.spec.vocab_size)
    s = tail._TracedSimulation(prepared, make_router("ours", prepared, text), periods=FeedPeriods(0.5), seed=0)
    res = s.run()
    rows = tail.decompose(s, TimingModel())
    assert len(rows) == res.num_measured
    for r in rows:
        assert r["queue"] >= 0 and r["own"] >= TimingModel().step_base_s
        assert r["queue"] + r["own"] + r["interference"] == pytest.approx(r["ttft"])
        assert r["reason"] in {"affinity", "released", "new_group", "spill", "hot_replica"}
    assert np.percentile([r["ttft"] for r in rows], 99) == pytest.approx(res.ttft_p99_s)
    t = tail.tail_summary(rows, 95)
    assert t["n"] == sum(r["ttft"] > t["cut_s"] for r in rows) > 0
