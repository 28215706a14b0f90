"""benchmarks/routing/real.py's open-loop mode: the trace (documents, Poisson arrivals), the driver that
sends each request at its arrival whatever is in flight, and the figures it adds. No Ray here: the real run
is `python -m benchmarks.routing.real --emulate --rate ...`."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from benchmarks.routing import real
from benchmarks.routing.real import BenchSpec, RequestResult, build_trace, cold_start_requests, summarize

VOCAB = 1000


def test_documents_are_inserted_without_changing_the_rest_of_the_trace():
    plain = build_trace(BenchSpec(requests=400, tenants=8), VOCAB)
    with_docs = build_trace(BenchSpec(requests=400, tenants=8, doc_share=0.3, doc_tokens=(100.0, 1.0, 20, 600)),
                            VOCAB)
    docs = 0
    for a, b in zip(plain, with_docs, strict=True):
        assert (a.req_id, a.group, len(a.output_token_ids)) == (b.req_id, b.group, len(b.output_token_ids))
        extra = len(b.prompt_token_ids) - len(a.prompt_token_ids)
        if b.component == "D":
            docs += 1
            assert 20 <= extra <= 600
        else:
            assert extra == 0 and a.prompt_token_ids == b.prompt_token_ids
        assert a.arrival_s == b.arrival_s == 0.0          # closed loop: no arrival times
    assert 0.2 < docs / len(plain) < 0.4


def test_a_document_sits_between_the_system_prompt_and_the_question():
    spec = BenchSpec(requests=200, tenants=4, system_tokens=100, doc_share=0.5, doc_tokens=(50.0, 0.5, 10, 200))
    plain = build_trace(BenchSpec(requests=200, tenants=4, system_tokens=100), VOCAB)
    for a, b in zip(plain, build_trace(spec, VOCAB), strict=True):
        if b.component != "D":
            continue
        extra = len(b.prompt_token_ids) - len(a.prompt_token_ids)
        # find the tenant's system prompt length: the longest prefix a shares with another request of its group
        sys_len = min(_common(a.prompt_token_ids, r.prompt_token_ids) for r in plain
                      if r.group == a.group and r.req_id != a.req_id)
        assert b.prompt_token_ids[:sys_len] == a.prompt_token_ids[:sys_len]
        assert b.prompt_token_ids[sys_len + extra:] == a.prompt_token_ids[sys_len:]


def _common(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_open_loop_arrivals_are_poisson_at_the_rate():
    trace = build_trace(BenchSpec(requests=3000, rate=5.0), VOCAB)
    t = np.array([r.arrival_s for r in trace])
    assert np.all(np.diff(t) > 0)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(0.2, rel=0.06)
    assert gaps.std() == pytest.approx(0.2, rel=0.1)           # exponential: std = mean


def test_a_request_longer_than_the_model_is_refused_naming_the_knob():
    with pytest.raises(ValueError, match="--doc-tokens"):
        build_trace(BenchSpec(system_tokens=400, doc_share=0.1, doc_tokens=(300.0, 1.0, 64, 2000)), VOCAB)


@pytest.mark.parametrize("bad,match", [(dict(rate=-1.0), "--rate"), (dict(doc_share=1.5), "--doc-share"),
                                       (dict(doc_share=-0.1), "--doc-share")])
def test_a_negative_rate_or_a_share_outside_0_1_is_refused_naming_the_flag(bad, match):
    with pytest.raises(ValueError, match=match):
        build_trace(BenchSpec(**bad), VOCAB)


def test_the_cold_start_left_out_is_a_tenth_open_loop_and_two_rounds_closed():
    assert cold_start_requests(BenchSpec(requests=300, rate=4.0)) == 30
    assert cold_start_requests(BenchSpec(requests=300, concurrency=16)) == 32


def test_the_document_p99_counts_only_requests_with_a_document_after_the_cold_start():
    results = [RequestResult(f"R{i:05d}", ok=True, ttft_s=t, e2e_s=t + 1, replica_id="a")
               for i, t in enumerate([9.0, 0.1, 0.2, 3.0, 0.3, 2.0])]
    out = summarize("p", results, 10.0, {}, {}, skip=1, doc_ids={"R00000", "R00003", "R00005"})
    assert out.ttft_p99_doc_ms == pytest.approx(np.percentile([3000.0, 2000.0], 99))
    assert out.ttft_p99_steady_ms == pytest.approx(np.percentile([100.0, 200.0, 3000.0, 300.0, 2000.0], 99))


def _fake_requests(monkeypatch, seconds: float) -> dict[str, float]:
    """Replace the HTTP request with one that takes `seconds`; returns request id -> when it was sent."""
    sent: dict[str, float] = {}

    async def fake(client, url, r, timeout_s):
        sent[r.req_id] = time.monotonic()
        await asyncio.sleep(seconds)
        return RequestResult(r.req_id, ok=True, ttft_s=seconds, e2e_s=seconds)

    monkeypatch.setattr(real, "_one_request", fake)
    return sent


def test_the_open_loop_driver_sends_each_request_at_its_arrival_whatever_is_in_flight(monkeypatch):
    """Each fake request takes 0.6 s; arrivals are 0.1 s apart: a closed loop of one would send the third at
    1.2 s, the open loop sends it at 0.2 s. Requests past the deadline are not sent."""
    sent = _fake_requests(monkeypatch, 0.6)
    trace = [real.TraceRequest(f"R{i}", 0.1 * i, "A", "g", [5, 6], [0]) for i in range(4)]
    trace.append(real.TraceRequest("late", 30.0, "A", "g", [5, 6], [0]))
    t0 = time.monotonic()
    results, wall = asyncio.run(real.drive_open("http://unused", trace, t0 + 5.0, 10.0, "test"))
    assert sorted(r.req_id for r in results) == ["R0", "R1", "R2", "R3"]
    offsets = [sent[f"R{i}"] - sent["R0"] for i in range(4)]
    for i, off in enumerate(offsets):
        assert 0.1 * i - 0.01 <= off < 0.1 * i + 0.25, offsets     # sent on time, not after the one before
    assert max(offsets) < 0.6                 # the last was sent while the first was still in flight
    assert sent["R0"] - t0 < 2.0
    assert wall < 3.0                         # the late request was not waited for


def test_the_closed_loop_driver_keeps_concurrency_requests_in_flight(monkeypatch):
    """Concurrency 2, each fake request 0.4 s: two go at once, the next two when those finish."""
    sent = _fake_requests(monkeypatch, 0.4)
    trace = [real.TraceRequest(f"R{i}", 0.0, "A", "g", [5, 6], [0]) for i in range(4)]
    t0 = time.monotonic()
    results, wall = asyncio.run(real.drive("http://unused", trace, 2, t0 + 10.0, 10.0, "test"))
    assert sorted(r.req_id for r in results) == ["R0", "R1", "R2", "R3"]
    offsets = [sent[f"R{i}"] - sent["R0"] for i in range(4)]
    assert offsets[1] < 0.2, offsets
    assert 0.38 <= offsets[2] < 0.7 and 0.38 <= offsets[3] < 0.7, offsets


def test_the_offered_load_is_the_rate_over_the_emulated_fleets_prefill_rate_and_only_there():
    spec = BenchSpec(requests=200, rate=4.0, replicas=2, emulate=True)
    trace = build_trace(spec, VOCAB)
    mean_prompt = sum(len(r.prompt_token_ids) for r in trace) / len(trace)
    assert real.offered_load(spec, trace) == pytest.approx(4.0 * mean_prompt * 1e-3 / 2)
    assert np.isnan(real.offered_load(BenchSpec(requests=200, rate=4.0), trace))       # not emulated
    assert np.isnan(real.offered_load(BenchSpec(requests=200, emulate=True), trace))   # closed loop


def test_the_router_line_reads_a_load_only_policy():
    """A load-only policy's state reports its index accuracy as null: the run printed a TypeError after the
    trace instead of its results (power_of_two)."""
    from benchmarks.routing.real import router_line
    line = router_line({"by_reason": {"load": 3}, "index_accuracy": None, "prefill_tokens_per_s": 2000.0})
    assert "index accuracy n/a" in line and "2000 tok/s" in line
    line = router_line({"by_reason": {}, "index_accuracy": 0.98, "prefill_tokens_per_s": 8000.0})
    assert "index accuracy 0.98" in line and "8000 tok/s" in line
