"""The router's decision reaches the request's `llm.routing` span and the routing metrics at the ingress
(OpenTelemetry's in-memory span exporter and metric reader; the router is played by the fake replica,
which leaves a decision on the request before streaming, as AffinityRequestRouter does in the ingress's
process)."""
from __future__ import annotations


import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import CompletionRequest, ReplicaChunk
from affinity_serve.app.routing.api import CandidateScores, Decision, Reason
from affinity_serve.app.serving import OpenAIServing
from affinity_serve.engine import EngineLimits
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver
from tests.unit.app.conftest import LocalHandle

LIMITS = EngineLimits(max_model_len=256, vocab_size=1000, max_kv_tokens=1024, block_size=4)


def _decision(req_id: str, reason: Reason = Reason.AFFINITY) -> Decision:
    scores = CandidateScores(["r1", "r2"], [0, 32], [0.4, 0.1], [64, 8], [3, 1], [0.5, 0.25])
    return Decision(req_id, ["r2", "r1"], "r2", reason, scores, 0.0004, affinity_replica_id="r2")


class RoutedReplica:
    """Posts a decision for each request (the router's part), then streams two tokens from `ran_on`."""

    def __init__(self, ran_on: str = "r2", cached: int = 28, fail: bool = False):
        self.ran_on, self.cached, self.fail = ran_on, cached, fail

    async def limits(self):
        return LIMITS

    async def generate(self, req):
        req.routing.value = _decision(req.req_id)
        if self.fail:
            raise RuntimeError("replica died")
        for t in range(2):
            yield ReplicaChunk("", 0, "", [10 + t], "length" if t else None,
                               num_prompt_tokens=len(req.prompt_token_ids),
                               num_cached_tokens=self.cached, replica_id=self.ran_on)


def _serving(replica):
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    metrics = ServingMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"))
    serving = OpenAIServing(LocalHandle(replica), model_name="m", tokenizer=None, first_output_timeout_s=5,
                            observer=RequestObserver(tp.get_tracer("t"), metrics), metrics=metrics)
    return serving, spans, reader


def _points(reader) -> dict[str, list]:
    return {m.name: list(m.data.data_points) for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics}


def _routing_span(spans):
    [span] = [s for s in spans.get_finished_spans() if s.name == "llm.routing"]
    return dict(span.attributes)


async def test_the_routing_span_carries_the_decision_and_the_metrics_count_it():
    serving, spans, reader = _serving(RoutedReplica())
    req = CompletionRequest(prompt=list(range(40)), max_tokens=2)
    await serving.complete(RequestKind.COMPLETION, req, "cmpl-1", {})
    attrs = _routing_span(spans)
    assert attrs["routing.reason"] == "affinity" and attrs["routing.chosen"] == "r2"
    assert attrs["routing.replica"] == "r2" and attrs["routing.affinity_replica"] == "r2"
    assert attrs["routing.candidates"] == ("r1", "r2")
    assert attrs["routing.candidates.predicted_cached_tokens"] == (0, 32)
    assert attrs["routing.candidates.queued_prefill_tokens"] == (64, 8)
    assert attrs["routing.candidates.num_running"] == (3, 1)
    assert attrs["routing.candidates.kv_cache_usage"] == (0.5, 0.25)
    assert attrs["routing.candidates.predicted_ttft_s"] == (0.4, 0.1)
    assert attrs["routing.predicted_ttft_s"] == 0.1 and attrs["routing.decision_time_s"] == 0.0004
    assert attrs["routing.predicted_cached_tokens"] == 32 and attrs["routing.actual_cached_tokens"] == 28
    assert attrs["routing.num_decisions"] == 1
    pts = _points(reader)
    [decisions] = pts["affinity_routing_decisions"]
    assert decisions.value == 1 and dict(decisions.attributes) == {"reason": "affinity"}
    assert pts["affinity_routing_decision_time"][0].sum == pytest.approx(0.0004)
    assert pts["affinity_routing_predicted_cached_tokens"][0].value == 32
    assert pts["affinity_routing_actual_cached_tokens"][0].value == 28


async def test_a_request_run_elsewhere_is_scored_where_it_ran_and_each_prompt_is_counted():
    serving, spans, reader = _serving(RoutedReplica(ran_on="r1", cached=0))   # Serve walked down the ranks
    req = CompletionRequest(prompt=[list(range(20)), list(range(30))], max_tokens=2)
    chunks = [c async for c in serving.stream(RequestKind.COMPLETION, req, "cmpl-2", {})]
    assert chunks
    attrs = _routing_span(spans)
    assert attrs["routing.chosen"] == "r2" and attrs["routing.replica"] == "r1"
    assert attrs["routing.predicted_cached_tokens"] == 0 and attrs["routing.num_decisions"] == 2
    assert _points(reader)["affinity_routing_decisions"][0].value == 2


async def test_without_a_router_the_span_has_no_routing_attributes():
    class Unrouted(RoutedReplica):
        async def generate(self, req):
            yield ReplicaChunk("", 0, "", [1], "length", num_prompt_tokens=4, replica_id="r1")

    serving, spans, reader = _serving(Unrouted())
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=1), "c", {})
    assert not [k for k in _routing_span(spans) if k.startswith("routing.")]
    assert "affinity_routing_decisions" not in _points(reader)


async def test_a_fallback_decision_has_empty_candidate_lists_and_no_ttft():
    class Fallback(RoutedReplica):
        async def generate(self, req):
            req.routing.value = Decision(req.req_id, ["r1"], "r1", Reason.FALLBACK, CandidateScores.empty(), 0.0)
            yield ReplicaChunk("", 0, "", [1], "length", num_prompt_tokens=4, num_cached_tokens=4, replica_id="r1")

    serving, spans, _ = _serving(Fallback())
    await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=1), "c", {})
    attrs = _routing_span(spans)
    assert attrs["routing.reason"] == "fallback" and attrs["routing.candidates"] == ()
    assert "routing.predicted_ttft_s" not in attrs and attrs["routing.predicted_cached_tokens"] == 0


def test_the_decision_stays_in_the_ingress_process():
    """What the router leaves on the request is not pickled with it to the replica."""
    import pickle

    from affinity_serve.app.protocol import GenerateRequest
    from affinity_serve.engine import SamplingParams
    req = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=1), cached_on=[("r2", 16)])
    req.routing.value = _decision("r1")
    sent = pickle.loads(pickle.dumps(req))
    assert sent.routing.value is None and sent.cached_on == [("r2", 16)] and req.routing.value is not None
    assert len(pickle.dumps(req)) < len(pickle.dumps(_decision("r1"))) + 400


async def test_a_stream_its_client_left_still_counts_its_routing_and_says_where_it_ran():
    """Acceptance: a client that disconnected mid-stream left a request span with no replica, no `llm.routing`
    child and an empty error description, and its decision out of affinity_routing_decisions."""
    class Long(RoutedReplica):
        async def generate(self, req):
            req.routing.value = _decision(req.req_id)
            for t in range(100):
                yield ReplicaChunk("", 0, "a", [10 + t], None, num_prompt_tokens=len(req.prompt_token_ids),
                                   num_cached_tokens=12, replica_id="r2")

    serving, spans, reader = _serving(Long())
    gen = serving.stream(RequestKind.COMPLETION, CompletionRequest(prompt=list(range(40)), max_tokens=100), "s", {})
    assert await anext(gen)
    await gen.aclose()                          # what the HTTP layer does when the client goes away
    attrs = _routing_span(spans)
    assert attrs["routing.reason"] == "affinity" and attrs["routing.replica"] == "r2"
    [request] = [s for s in spans.get_finished_spans() if s.name == "llm.request"]
    assert request.attributes["replica"] == "r2" and request.attributes["error"] == "GeneratorExit"
    assert request.status.description == "the client went away mid-stream"
    [decisions] = _points(reader)["affinity_routing_decisions"]
    assert decisions.value == 1
    assert "affinity_request_ttft" not in {k for k, v in _points(reader).items() if v}     # finished ones only


async def test_a_request_refused_before_any_output_records_no_routing():
    serving, spans, reader = _serving(RoutedReplica(fail=True))
    with pytest.raises(RuntimeError, match="replica died"):
        await serving.complete(RequestKind.COMPLETION, CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=1), "c", {})
    data = reader.get_metrics_data()
    assert data is None or "affinity_routing_decisions" not in _points(reader)
    [request] = [s for s in spans.get_finished_spans() if s.name == "llm.request"]
    assert "replica" not in request.attributes
