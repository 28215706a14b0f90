"""benchmarks/structured.py (issue 27) runs end to end on a tiny setting: every constrained mode timed against
the unconstrained baseline in the same run, the batch-32 breakdown for the fill-when-read and ask-first
modes, the verdict against the 5% target for the engine's own mode, and the JSON it writes."""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("xgrammar")


def test_the_structured_benchmark_times_every_mode_against_the_baseline(tmp_path, monkeypatch, capsys):
    from benchmarks import structured
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["structured", "--models", "demo", "--vocab", "padded", "--batches", "2", "32",
                                      "--steps", "2", "--repeats", "1", "--json", str(out)])
    structured.main()
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["modes"] == ["free", "lazy", "thread", "check"]
    assert [(r["model"], r["batch"]) for r in data["decode"]] == [("demo", 2), ("demo", 32)]
    for r in data["decode"]:
        assert all(r[f"{m}_ms"] > 0 and len(r["repeats_ms"][m]) == 1 for m in data["modes"])
        assert all(f"{m}_overhead" in r for m in data["modes"][1:])
    b32 = data["decode"][1]
    assert b32["breakdown_ms"]["fill"] > 0 and "sampler_free" in b32["breakdown_check_ms"]
    assert "demo batch 32:" in printed and "(check)" in printed
    assert set(data["compile_s"]) == set(structured.SCHEMAS)
