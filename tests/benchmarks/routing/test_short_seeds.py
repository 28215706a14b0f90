"""benchmarks/routing/short_seeds.py: the short-prompt cells over seeds, every router against llm-d's on the
same trace; and the simulator's record of each request's engine-measured KV wait."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.routing import short_seeds
from benchmarks.routing.simulator import FeedPeriods, Simulation, TokenText, make_router, prepare
from benchmarks.routing.workload import WorkloadSpec, generate


def test_each_trace_is_compared_with_llmd_on_the_same_trace_and_summarized(tmp_path, capsys):
    out = tmp_path / "s.json"
    short_seeds.main(["--seeds", "0", "--routers", "ours:measured_kv_wait_weight=0,ours",
                      "--requests-per-replica", "15", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["routers"] == ["ours:measured_kv_wait_weight=0", "ours", "llmd"]
    assert len(doc["rows"]) == 4                                  # the four cells, one seed
    s = doc["summary"]
    assert s["llmd"]["ttft_p99_vs_llmd_geomean"] == pytest.approx(1.0)
    for name in ("ours", "ours:measured_kv_wait_weight=0"):
        ratios = [r["routers"][name]["ttft_p99_s"] / r["routers"]["llmd"]["ttft_p99_s"] for r in doc["rows"]]
        assert s[name]["ttft_p99_vs_llmd_geomean"] == pytest.approx(float(np.exp(np.mean(np.log(ratios)))))
        assert s[name]["traces"] == 4 and 0 < s[name]["hit_vs_bound_mean"]
    assert "| ours |" in capsys.readouterr().out


def test_the_simulator_records_the_kv_wait_the_engine_measured():
    """A small pool under load: some requests wait for blocks, and a request's recorded wait is never more
    than its TTFT."""
    trace = generate(WorkloadSpec(num_replicas=2, pressure=1.5, load=1.5, requests_per_replica=60, seed=3))
    prepared = prepare(trace)
    sim = Simulation(prepared, make_router("ours", prepared, TokenText(trace.meta.spec.vocab_size)),
                     periods=FeedPeriods.default(2), seed=3)
    sim.run()
    rec = sim.rec
    ttft = rec.first - rec.release
    assert (rec.kv_wait > 0).any()
    assert (rec.kv_wait <= ttft + 1e-9).all()
