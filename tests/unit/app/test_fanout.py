"""Fan-out and gathering back: merged replica streams, unique engine ids, per-sequence results, best_of,
and the per-sequence time per output token (with the OpenTelemetry in-memory metric reader)."""
import asyncio
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

import affinity_serve.app.fanout  # noqa: F401

from affinity_serve import app
from affinity_serve.app.errors import APIError
from affinity_serve.app.fanout import RequestRun, merged_chunks, replica_requests
from affinity_serve.app.prompts import PreparedRequest, RequestKind
from affinity_serve.app.protocol import ReplicaChunk
from affinity_serve.engine import SamplingParams
from affinity_serve.engine.types import Logprobs
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver, RequestSpan
from tests.unit.app.conftest import LocalHandle


def _prepared(num_prompts=1, n=1, num_choices=None, request_id="client-id"):
    return PreparedRequest(RequestKind.COMPLETION, request_id, "m", [[1, 2]] * num_prompts, [None] * num_prompts,
                           SamplingParams(n=n), num_choices or n, logprobs=None, prompt_logprobs=None, echo=False,
                           echo_only=False, stream_usage=False, priority=0, cache_salt=None)


class _Streams:
    def __init__(self, delays):
        self.delays = delays

    async def generate(self, req):
        for i in range(req.sampling_params.n):
            await asyncio.sleep(self.delays[req.prompt_token_ids[0]])
            yield ReplicaChunk("", i, f"p{req.prompt_token_ids[0]}s{i}", [1], "length", replica_id="r")


def test_every_prompt_gets_its_own_engine_id_and_keeps_the_client_id():
    reqs = replica_requests(_prepared(num_prompts=3), {"traceparent": "x"})
    assert len({r.req_id for r in reqs}) == 3 and "client-id" not in {r.req_id for r in reqs}
    assert {r.request_id for r in reqs} == {"client-id"} and reqs[0].trace_context == {"traceparent": "x"}
    assert len({r.req_id for r in replica_requests(_prepared(), {})} | {reqs[0].req_id}) == 2


async def test_merged_chunks_number_sequences_prompt_major_as_they_arrive():
    p = _prepared(num_prompts=2, n=2)
    reqs = replica_requests(p, {})
    reqs[0].prompt_token_ids, reqs[1].prompt_token_ids = [0], [1]
    got = [(idx, c.text) async for idx, c in merged_chunks(LocalHandle(_Streams({0: 0.05, 1: 0.0})), reqs, 5)]
    assert sorted(got) == [(0, "p0s0"), (1, "p0s1"), (2, "p1s0"), (3, "p1s1")]
    assert got[0] == (2, "p1s0")                       # the faster prompt's stream is not held back


async def test_a_silent_replica_is_a_503_and_its_stream_is_cancelled():
    class Silent:
        async def generate(self, req):
            await asyncio.sleep(3600)
            yield None

    with pytest.raises(APIError) as e:
        async for _ in merged_chunks(LocalHandle(Silent()), replica_requests(_prepared(num_prompts=2), {}), 0.1):
            pass
    assert e.value.status_code == 503


def test_best_of_keeps_the_highest_cumulative_logprob_per_prompt():
    run = RequestRun(_prepared(num_prompts=2, n=3, num_choices=1))
    for idx, score in enumerate([-1.0, -0.2, -3.0, -5.0, -4.0, -0.1]):
        run.add(idx, ReplicaChunk("", idx % 3, f"s{idx}", [1, 2], "length",
                                  logprobs=[Logprobs(1, score, 1, [], []), Logprobs(2, 0.0, 1, [], [])]))
    assert [s.text for s in run.choices()] == ["s1", "s5"]
    assert run.num_output_tokens == 12


def test_tpot_is_recorded_per_sequence_not_over_all_choices(monkeypatch):
    """n=2: sequence 0 makes 5 tokens 0.1 s apart, sequence 1 makes 2 tokens 0.3 s apart. TPOT is 0.1 and
    0.3 (one sample each), not (e2e - ttft) / (all 7 tokens - 1)."""
    run = RequestRun(_prepared(n=2))
    now = {"ns": 0}
    monkeypatch.setattr(app.fanout.time, "time_ns", lambda: now["ns"])
    for t_s, idx in [(1.0, 0), (1.0, 1), (1.1, 0), (1.2, 0), (1.3, 0), (1.3, 1), (1.4, 0)]:
        now["ns"] = int(t_s * 1e9)
        run.add(idx, ReplicaChunk("", idx, "x", [7], replica_id="r1"))
    record = run.record()
    assert [round(t, 6) for t in record.tpot_s] == [0.1, 0.3]
    reader = InMemoryMetricReader()
    tracer = TracerProvider().get_tracer("t")
    observer = RequestObserver(tracer, ServingMetrics(MeterProvider(metric_readers=[reader]).get_meter("t")))
    observer.finish(RequestSpan(tracer.start_span("x"), time.time_ns()), record)
    points = {m.name: list(m.data.data_points) for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    tpot = points["affinity_time_per_output_token"][0]
    assert tpot.count == 2 and abs(tpot.sum - 0.4) < 1e-9
