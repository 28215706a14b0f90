"""One request's telemetry at the ingress: its span (with routing/queue/prefill/decode children), its
"request finished" log line, and its metrics, all from one `RequestRecord`."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from affinity_serve.observability import names
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.tracing import context_from_carrier, inject_carrier, trace_id_hex

logger = logging.getLogger("affinity.requests")


@dataclass(slots=True)
class RoutingRecord:
    """One routing decision as the ingress reports it (plain values; built from app.routing's Decision).

    `candidate_*` are columns, index i = `candidate_ids[i]` (empty for a fallback). `predicted_cached_tokens`
    is what the router predicted for the replica the request ran on (0 if it was not scored there);
    `actual_cached_tokens` what that replica's engine found (None if it never said).
    """

    reason: str
    chosen: str
    replica_id: str
    decision_time_s: float
    predicted_cached_tokens: int
    actual_cached_tokens: int | None
    predicted_ttft_s: float | None = None            # the chosen replica's
    affinity_replica_id: str | None = None
    candidate_ids: list[str] = field(default_factory=list)
    candidate_predicted_cached_tokens: list[int] = field(default_factory=list)
    candidate_predicted_ttft_s: list[float] = field(default_factory=list)
    candidate_queued_prefill_tokens: list[int] = field(default_factory=list)
    candidate_num_running: list[int] = field(default_factory=list)
    candidate_kv_cache_usage: list[float] = field(default_factory=list)
    #: of candidate_predicted_cached_tokens, those to load from a KV tier (the rest: pool hits)
    candidate_predicted_tier_cached_tokens: list[int] = field(default_factory=list)

    def span_attributes(self) -> dict[str, Any]:
        """OpenTelemetry attributes (primitives and homogeneous lists; None values left out)."""
        attrs: dict[str, Any] = {
            "routing.reason": self.reason, "routing.chosen": self.chosen, "routing.replica": self.replica_id,
            "routing.decision_time_s": self.decision_time_s,
            "routing.predicted_cached_tokens": self.predicted_cached_tokens,
            "routing.actual_cached_tokens": self.actual_cached_tokens,
            "routing.predicted_ttft_s": self.predicted_ttft_s,
            "routing.affinity_replica": self.affinity_replica_id,
            "routing.candidates": list(self.candidate_ids),
            "routing.candidates.predicted_cached_tokens": [int(v) for v in self.candidate_predicted_cached_tokens],
            "routing.candidates.predicted_ttft_s": [float(v) for v in self.candidate_predicted_ttft_s],
            "routing.candidates.queued_prefill_tokens": [int(v) for v in self.candidate_queued_prefill_tokens],
            "routing.candidates.num_running": [int(v) for v in self.candidate_num_running],
            "routing.candidates.kv_cache_usage": [float(v) for v in self.candidate_kv_cache_usage],
            "routing.candidates.predicted_tier_cached_tokens":
                [int(v) for v in self.candidate_predicted_tier_cached_tokens]}
        return {k: v for k, v in attrs.items() if v is not None}


@dataclass(slots=True)
class RequestRecord:
    """What the ingress learned about one finished request."""

    request_id: str
    model: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    replica_ids: list[str] = field(default_factory=list)
    replica_trace_ids: list[str] = field(default_factory=list)    # the replicas' engine spans
    first_token_ns: int | None = None                             # time.time_ns() at the ingress
    tpot_s: list[float] = field(default_factory=list)             # one per sequence with 2+ tokens
    #: phase durations measured in the replica that finished first (seconds)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: one per prompt whose first token arrived, in that order (none: no router in this process routed it)
    routing: list[RoutingRecord] = field(default_factory=list)


@dataclass(slots=True)
class RequestSpan:
    span: trace.Span
    start_ns: int

    @property
    def carrier(self) -> dict[str, str]:
        """The W3C context to send downstream, so replica spans join this trace."""
        return inject_carrier(trace.set_span_in_context(self.span))


#: what ended a request whose exception says nothing itself
_ENDED = {GeneratorExit: "the client went away mid-stream", asyncio.CancelledError: "cancelled (the client went away)"}


class RequestObserver:
    def __init__(self, tracer: trace.Tracer, metrics: ServingMetrics):
        self.tracer = tracer
        self.metrics = metrics

    @contextmanager
    def span(self, carrier: dict[str, str] | None, attributes: dict[str, Any]) -> Iterator[RequestSpan]:
        """The request's root span, a child of the caller's trace context when there is one."""
        parent = context_from_carrier(carrier) if carrier else None
        start = time.time_ns()
        span = self.tracer.start_span(names.SPAN_REQUEST, context=parent, start_time=start, attributes=attributes)
        try:
            yield RequestSpan(span, start)
        except BaseException as e:
            span.set_attribute("error", type(e).__name__)
            # a client gone mid-stream ends it with GeneratorExit (or CancelledError), whose str() is empty
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)[:200] or _ENDED.get(type(e), type(e).__name__)))
            raise
        finally:
            span.end()

    def finish(self, rs: RequestSpan, r: RequestRecord) -> None:
        """Attributes and phase children on the span, one log line, the request metrics."""
        end = time.time_ns()
        replica = self._known(rs, r)
        span = rs.span
        span.set_attribute("trace_id", trace_id_hex(span))
        if r.replica_trace_ids:
            span.set_attribute("replica_trace_id", ",".join(sorted(set(r.replica_trace_ids))))
        self._phase_spans(rs, r, end, replica)
        ttft = (r.first_token_ns - rs.start_ns) / 1e9 if r.first_token_ns else None
        e2e = (end - rs.start_ns) / 1e9
        logger.info("request finished", extra={
            "request_id": r.request_id, "replica": replica, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens,
            "ttft_s": round(ttft, 4) if ttft is not None else None, "e2e_s": round(e2e, 4)})
        self.metrics.record_request(model=r.model, prompt_tokens=r.num_prompt_tokens,
                                    output_tokens=r.num_output_tokens, cached_tokens=r.num_cached_tokens,
                                    ttft_s=ttft, e2e_s=e2e, tpot_s=r.tpot_s)
        self._count_routing(r)

    def ended_early(self, rs: RequestSpan, r: RequestRecord) -> None:
        """A request that ended before its last output (its client went away, a failure mid-stream), once some
        replica output had arrived: what is known of it on its span (replica, tokens so far, an `llm.routing`
        child with its decision) and its routing decisions in the routing metrics, which count every routed
        request. The request metrics (TTFT, end-to-end, tokens) count finished requests only."""
        replica = self._known(rs, r)
        if r.routing:
            child = self.tracer.start_span(names.SPAN_ROUTING, context=trace.set_span_in_context(rs.span),
                                           start_time=rs.start_ns, attributes=_routing_attributes(r, replica))
            child.end(end_time=max(rs.start_ns, r.first_token_ns or time.time_ns()))
        self._count_routing(r)

    @staticmethod
    def _known(rs: RequestSpan, r: RequestRecord) -> str:
        """The request span's tokens and replica(s), finished or not; the replica attribute's value."""
        replica = ",".join(sorted(set(r.replica_ids)))
        rs.span.set_attribute("output_tokens", r.num_output_tokens)
        rs.span.set_attribute("cached_tokens", r.num_cached_tokens)
        rs.span.set_attribute("replica", replica)
        return replica

    def _count_routing(self, r: RequestRecord) -> None:
        for d in r.routing:
            self.metrics.record_routing(reason=d.reason, decision_time_s=d.decision_time_s,
                                        predicted_cached_tokens=d.predicted_cached_tokens,
                                        actual_cached_tokens=d.actual_cached_tokens)

    def _phase_spans(self, rs: RequestSpan, r: RequestRecord, end: int, replica: str) -> None:
        """routing | queue | prefill | decode, laid back from the end with the replica's own timings. The
        routing span carries the first prompt's decision (`routing.num_decisions`: how many prompts were
        routed; each one is in the metrics)."""
        decode_start = end - int(r.decode_s * 1e9)
        prefill_start = decode_start - int(r.prefill_s * 1e9)
        queue_start = max(rs.start_ns, prefill_start - int(r.queue_s * 1e9))
        prefill_start = max(prefill_start, queue_start)
        decode_start = max(decode_start, prefill_start)
        ctx = trace.set_span_in_context(rs.span)
        phases = ((names.SPAN_ROUTING, rs.start_ns, queue_start), (names.SPAN_QUEUE, queue_start, prefill_start),
                  (names.SPAN_PREFILL, prefill_start, decode_start), (names.SPAN_DECODE, decode_start, end))
        for name, a, b in phases:
            attrs: dict[str, Any] = {"replica": replica}
            if name == names.SPAN_ROUTING and r.routing:
                attrs = _routing_attributes(r, replica)
            child = self.tracer.start_span(name, context=ctx, start_time=a, attributes=attrs)
            child.end(end_time=max(a, b))


def _routing_attributes(r: RequestRecord, replica: str) -> dict[str, Any]:
    """The `llm.routing` span's attributes: the first prompt's decision and how many prompts were routed."""
    return {"replica": replica} | r.routing[0].span_attributes() | {"routing.num_decisions": len(r.routing)}
