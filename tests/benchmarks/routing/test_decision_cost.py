"""benchmarks/routing/decision_cost.py on a small fleet: it builds the index from KV events, times the decision,
the admission prediction beside it, and the llm-d-style scorer, and reports what the docs table shows."""
from __future__ import annotations

from benchmarks.routing import decision_cost


def test_the_decision_cost_benchmark_reports_the_decision_the_admission_and_the_llmd_scorer():
    r = decision_cost.run(8, 2_000, 300, seed=1, say=lambda *_: None)
    assert r["replicas"] == 8 and r["index_hashes"] > 1_000 and r["requests"] == 300
    for key in ("ours_cpu_ms", "admission_cpu_ms", "ours_with_admission_cpu_ms", "llmd_cpu_ms"):
        assert 0 < r[key]["p50"] <= r[key]["p99"], (key, r[key])
    # the total is the two parts of the same requests
    assert r["ours_with_admission_cpu_ms"]["p50"] >= r["ours_cpu_ms"]["p50"]
    assert r["ours_with_admission_cpu_ms"]["p50"] >= r["admission_cpu_ms"]["p50"]
