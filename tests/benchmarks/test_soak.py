"""benchmarks/soak.py's pure parts: slopes, the leak/plateau verdict, the table, growth diffs (no Ray)."""
from __future__ import annotations

import json
import random
from collections import deque

import pytest

from benchmarks import soak


def test_slope_per_min_of_a_line_and_of_flat_data():
    ts = [0, 30, 60, 90, 120]
    assert soak.slope_per_min(ts, [100 + 2 * t / 60 for t in ts]) == pytest.approx(2.0)
    assert soak.slope_per_min(ts, [50.0] * 5) == 0.0
    assert soak.slope_per_min([10], [1.0]) == 0.0           # too few points
    assert soak.slope_per_min([5, 5], [1.0, 2.0]) == 0.0    # no spread in time


def test_verdict_separates_leak_plateau_and_settling():
    assert soak.verdict(20.0, 0.3, flat=1.0) == "plateau"
    assert soak.verdict(5.0, 5.2, flat=1.0) == "leak?"
    assert soak.verdict(20.0, 4.0, flat=1.0) == "settling"
    # per request: the same MB/min at 3x the request rate is a third of the growth per request
    assert soak.verdict(40.0, 44.0, flat=1.0, per_req_first=60.0, per_req_second=20.0) == "settling"
    assert soak.verdict(10.0, 30.0, flat=1.0, per_req_first=5.0, per_req_second=5.0) == "leak?"


def test_analyze_series_per_request_slopes_see_through_a_changing_request_rate():
    ts = [10.0 * i for i in range(61)]
    reqs = [10.0 * t if t <= 300 else 3000 + 30.0 * (t - 300) for t in ts]   # 10/s, then 30/s
    leak = soak.analyze_series(ts, [500 + 0.002 * r for r in reqs], t_start=0, flat=1.0, requests=reqs)
    assert leak["per_1k_requests_first_half"] == pytest.approx(2.0)
    assert leak["per_1k_requests_second_half"] == pytest.approx(2.0)
    assert leak["slope_second_half"] == pytest.approx(3 * leak["slope_first_half"])
    assert leak["verdict"] == "leak?" and leak["requests"] == pytest.approx(reqs[-1])
    assert soak.analyze_series(ts, ts, t_start=0, flat=1.0)["per_1k_requests_first_half"] is None


def test_analyze_series_steady_growth_is_a_leak_and_a_saturating_curve_a_plateau():
    ts = [10.0 * i for i in range(61)]                        # 10 minutes, a sample every 10 s
    leak = soak.analyze_series(ts, [300 + 3 * t / 60 for t in ts], t_start=60, flat=1.0)
    assert leak["verdict"] == "leak?"
    assert leak["slope_first_half"] == pytest.approx(3.0) and leak["slope_second_half"] == pytest.approx(3.0)
    assert leak["start_mb"] == pytest.approx(303) and leak["growth_mb"] == pytest.approx(27)
    rng = random.Random(0)
    plateau = [300 + 200 * min(1.0, t / 200) + rng.uniform(-1, 1) for t in ts]   # flat from 200 s on
    p = soak.analyze_series(ts, plateau, t_start=60, flat=1.0)
    assert p["verdict"] == "plateau"
    assert p["slope_first_half"] > 5 and abs(p["slope_second_half"]) < 1.0
    with pytest.raises(ValueError):
        soak.analyze_series(ts, ts, t_start=10_000, flat=1.0)


def test_rss_table_has_a_row_per_process_and_the_trimmed_column():
    row = soak.analyze_series([0, 60, 120], [100, 110, 120], t_start=0, flat=1.0, requests=[0, 1000, 2000])
    bare = soak.analyze_series([0, 60, 120], [100, 110, 120], t_start=0, flat=1.0)
    text = soak.rss_table({"replica0": row | {"trimmed_mb": 90.4}, "ingress": bare})
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| process |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2].startswith("| replica0 | 100 | 120 | +20 | +10.00 |")
    assert lines[2].endswith("| +10.0 | +10.0 | 90 | leak? |")
    assert lines[3].endswith("| - | - | - | leak? |")


def test_growth_diffs_keep_only_what_grew():
    assert soak.grown_containers({"a": 1, "b": 5}, {"a": 100, "b": 6, "c": 40}) == {"a": (1, 100), "c": (0, 40)}
    assert soak.grown_types({"dict": 10, "list": 5}, {"dict": 12, "list": 50, "Span": 3}, top=2) == [
        ("list", 5, 50), ("Span", 0, 3)]


def test_container_sizes_walks_our_objects_only():
    class Holder:          # defined in this test module: not one of the project's packages
        pass
    root = soak.SoakSpec()      # a project object (benchmarks.soak), slots, no containers
    assert soak.container_sizes(root) == {}
    h = Holder()
    h.items = {"a": 1}
    h.window = deque([1, 2, 3])
    assert soak.container_sizes(h, "h") == {"h.items": 1, "h.window": 3}


def test_build_request_covers_every_kind_and_bad_bodies_expect_4xx():
    rng = random.Random(1)
    for kind in soak.MIX:
        path, body, stream, expect_4xx = soak.build_request(kind, rng, vocab=730)
        assert path in ("/v1/completions", "/v1/chat/completions")
        assert expect_4xx == (kind == "bad")
        if kind == "batch":
            assert isinstance(body["prompt"], list) and len(body["prompt"]) >= 2
    assert sum(soak.MIX.values()) == pytest.approx(1.0)


def test_report_from_json_prints_the_table_of_an_earlier_run(tmp_path, capsys):
    samples = [{"t": 15.0 * i, "requests": 100 * i, "rss_mb": {"replica0": 1000 + 0.1 * i, "ingress": 500.0},
                "probe": {"replica0": {"heap_in_use_mb": 700.0}}} for i in range(20)]
    path = tmp_path / "soak.json"
    path.write_text(json.dumps({"spec": {"warmup_s": 60.0}, "samples": samples,
                                "rows": {"replica0": {"trimmed_mb": 950.0}}}))
    soak.report_from_json(str(path), flat=1.0, png=None)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in out[2:]] == ["| replica0", "| ingress", "| replica0 heap in use"]
    assert out[2].endswith("| 950 | plateau |") and out[3].endswith("| plateau |")
