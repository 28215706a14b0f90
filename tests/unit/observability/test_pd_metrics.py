"""P/D transfer metrics (issue 28): the decode side's reads, bytes, read times and fallbacks and the prefill
side's holds, hold times and held blocks, from two real P/D engines through the app's sample to Prometheus
text, labelled by replica; they move as transfers happen."""
from __future__ import annotations

import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from affinity_serve.app.disagg import pd_sample
from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.kv_connector import LocalTransport, RemoteDecode
from affinity_serve.observability.aggregate import render, snapshot_of
from affinity_serve.observability.metrics import PDSample, ReplicaLoadSample, ReplicaMetrics

_IDLE = ReplicaLoadSample(0, 0, 0.0, 0.0, 0.0, 0, 0, 0)
BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _metrics(reader, replica_id):
    return ReplicaMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), replica_id, lambda: _IDLE, "pd",
                          lambda: None)


def _text(reader) -> str:
    return render(snapshot_of(reader.get_metrics_data()), "tiny")


def _value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels, model="tiny"}` in Prometheus text (labels sorted, as render writes them)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model": "tiny"}.items()))
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(inner)}\}} (\S+)$", text, re.M)
    assert m, f"{name}{{{inner}}} not in\n{text}"
    return float(m.group(1))


def _engine(path, transport):
    e = LLM(path, cache={"num_blocks": 64, "block_size": BS},
            kv_connector={"type": "pd", "transfer_timeout_s": 30.0, "load_timeout_s": 30.0}).engine
    e.set_kv_transport(transport)
    transport.register(e.pd.engine_id, e.kv_source)
    return e


def _run(engine, rid, prompt, params, kv_transfer=None):
    engine.add_request(engine.make_request(prompt, params, kv_transfer=kv_transfer, req_id=rid))
    final = None
    for _ in range(500):
        for d in engine.step().deltas:
            if d.req_id == rid and d.finished:
                final = d
        if final is not None:
            return final
    raise AssertionError(f"{rid} did not finish")


def _sample(engine, prefill_failed=0) -> PDSample:
    return pd_sample(engine.take_pd_transfer_stats(), engine.kv_connector_stats(), prefill_failed)


def test_transfers_reach_prometheus_from_both_sides_and_move(checkpoints):
    path = checkpoints["llama"]
    transport = LocalTransport()
    p, d = _engine(path, transport), _engine(path, transport)
    reader_p, reader_d = InMemoryMetricReader(), InMemoryMetricReader()
    mp, md = _metrics(reader_p, "p1"), _metrics(reader_d, "d1")
    assert "affinity_pd_" not in _text(reader_d)          # no sample yet: no P/D series

    prompt = list(range(10, 10 + 5 * BS + 3))             # 5 full blocks move
    params = SamplingParams(max_tokens=4, **GREEDY)
    remote = _run(p, "a", prompt, SamplingParams(max_tokens=1, **GREEDY), RemoteDecode()).kv_transfer
    mp.record_pd(_sample(p))
    assert _value(_text(reader_p), "affinity_pd_held_blocks", replica="p1") == 5     # held for the reader

    _run(d, "a", prompt, params, [remote])
    for _ in range(5):
        p.step()                                          # the prefill side frees the read hold
    mp.record_pd(_sample(p))
    md.record_pd(_sample(d, prefill_failed=2))
    bb = d.pd.layout.block_bytes
    text_d, text_p = _text(reader_d), _text(reader_p)
    assert _value(text_d, "affinity_pd_transfers_total", replica="d1", outcome="read") == 1
    assert _value(text_d, "affinity_pd_transfer_blocks_total", replica="d1") == 5
    assert _value(text_d, "affinity_pd_transfer_bytes_total", replica="d1") == 5 * bb
    assert _value(text_d, "affinity_pd_transfer_time_seconds_count", replica="d1") == 1
    assert _value(text_d, "affinity_pd_fallbacks_total", replica="d1", cause="prefill_failed") == 2
    assert _value(text_d, "affinity_pd_fallbacks_total", replica="d1", cause="missing") == 0
    assert _value(text_p, "affinity_pd_holds_total", replica="p1", outcome="read") == 1
    assert _value(text_p, "affinity_pd_hold_time_seconds_count", replica="p1", outcome="read") == 1
    assert _value(text_p, "affinity_pd_held_blocks", replica="p1") == 0

    # a second transfer whose prefill engine is gone before the read: a fallback, and the counters move on
    remote = _run(p, "b", prompt[::-1], SamplingParams(max_tokens=1, **GREEDY), RemoteDecode()).kv_transfer
    transport.unregister(p.pd.engine_id)
    _run(d, "b", prompt[::-1], params, [remote])
    md.record_pd(_sample(d, prefill_failed=2))
    text_d = _text(reader_d)
    assert _value(text_d, "affinity_pd_transfers_total", replica="d1", outcome="failed") == 1
    assert _value(text_d, "affinity_pd_fallbacks_total", replica="d1", cause="missing") == 1
    assert _value(text_d, "affinity_pd_transfers_total", replica="d1", outcome="read") == 1
    assert _value(text_d, "affinity_pd_transfer_time_seconds_count", replica="d1") == 1      # no new read
    p.close()
    d.close()


def test_a_replica_without_pd_exports_no_pd_series():
    reader = InMemoryMetricReader()
    _metrics(reader, "r1")
    assert "affinity_pd_" not in _text(reader)
