"""benchmarks/engine_throughput_gpu.py (the GPU throughput benchmark) runs end to end on CPU with --tiny, so
the script is known to work before a GPU session spends its time on it; and its bandwidth floor counts
what a decode step must read."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_the_gpu_benchmark_runs_on_cpu_tiny_and_writes_its_rows(tmp_path, backend):
    """The shared-prefix case also runs without cascade decode; the rows say whether a step actually ran in
    cascade, and both rows' floors count the prefix's shared pages once (cascade or not, they are one copy in
the cache; without cascade the step re-reads them, which the floor must not excuse). With the triton backend
(interpreted here)
    only that case runs (--case)."""
    extra = ["--all"]
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
        extra = ["--case", "shared"]
    out = tmp_path / "gpu.json"
    # a 64 MiB KV pool holds every tiny case many times over; the default 16 GiB takes ~50 s to allocate on CPU
    r = subprocess.run([sys.executable, "-m", "benchmarks.engine_throughput_gpu", "--device", "cpu", "--tiny",
                        "--reps", "1", "--dtype", "float32", "--backend", backend, "--kv-budget-gib", "0.0625",
                        "--json", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["backend"] == backend and doc["copy_bandwidth_gb_s"] > 0
    cases = ["batch 1, 32 -> 8", "batch 4, 32 -> 8", "4 x (64 shared + 8) -> 8",
             "4 x (64 shared + 8) -> 8, no cascade", "MoE batch 4, 32 -> 8", "sliding batch 2, 200 -> 8"]
    rows = {row["case"]: row for row in doc["rows"]}
    assert list(rows) == (cases[2:4] if backend == "triton" else cases)
    assert doc["cascade_min_tokens"] == 64
    shared, plain = rows["4 x (64 shared + 8) -> 8"], rows["4 x (64 shared + 8) -> 8, no cascade"]
    assert shared["cascade"] and not plain["cascade"] and shared["floor_ms"] == plain["floor_ms"]
    assert not any(row["cascade"] for name, row in rows.items() if "shared" not in name)     # nothing shared
    for row in doc["rows"]:
        assert row["hf_tok_s"] > 0 and row["ours_tok_s"] > 0 and row["decode_step_ms"] > 0
        # the ratio is computed before rounding; the tiny model's floor is ~0.03 ms, so 3 decimals cost a few %
        assert row["step_over_floor"] == pytest.approx(row["decode_step_ms"] / row["floor_ms"], rel=0.05)
    if backend == "torch":
        # MoE: 4 tokens of top 2 of 8 experts activate 8 (1 - (3/4)^4) = 5.47 experts per layer on average
        assert rows["MoE batch 4, 32 -> 8"]["active_experts_per_layer"] == 5.5
        # sliding (window 32, 16-token blocks, 2 requests of ~204 tokens): the full group holds every block,
        # each sliding group its window's (2 blocks, 3 when unaligned) per request
        held = rows["sliding batch 2, 200 -> 8"]["blocks_held"]
        assert held[0] == [None, 26] and all(w == 32 and n <= 2 * 3 for w, n in held[1:])
    assert "step/floor" in r.stdout


def test_floor_bytes_counts_active_experts_and_windows():
    from benchmarks.engine_throughput_gpu import expected_active_experts, floor_bytes

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w = torch.nn.Parameter(torch.zeros(8, 3, 2))            # 8 experts of 6 parameters
    model.dense = torch.nn.Linear(2, 5, bias=False)                       # 10 parameters
    cfg = dict(hidden_size=4, num_heads=2, num_kv_heads=1, num_layers=2, head_dim=2)
    # 2 of 8 experts active: 12 expert parameters + 10; layer 0 reads min(9, 4) keys, layer 1 all 9
    assert floor_bytes(model, cfg, [9], 1, active_experts=2, layer_windows=[4, None]) == 22 + (4 + 9) * 2 * 1 * 2
    assert expected_active_experts(128, 8, 1) == pytest.approx(8)
    assert 100 < expected_active_experts(128, 8, 32) < 128


def test_floor_bytes_reads_each_weight_once_and_every_sequences_kv():
    from benchmarks.engine_throughput_gpu import floor_bytes

    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.embed, model.head = emb, torch.nn.Linear(4, 10, bias=False)
    model.head.weight = emb.weight                               # tied: counted once
    cfg = dict(hidden_size=4, num_heads=2, num_kv_heads=1, num_layers=3)
    # 40 parameters + contexts 5 + 7 tokens x 3 layers x (K, V) x 1 KV head x head dim 2, at 2 bytes each
    assert floor_bytes(model, cfg, [5, 7], 2) == (40 + 12 * 3 * 2 * 1 * 2) * 2


def test_a_case_filter_that_matches_nothing_is_an_error():
    r = subprocess.run([sys.executable, "-m", "benchmarks.engine_throughput_gpu", "--device", "cpu", "--tiny",
                        "--case", "batch 7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--case batch 7 matches none of the cases" in r.stderr
