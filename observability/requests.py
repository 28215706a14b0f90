"""One request's telemetry at the ingress: its span (with routing/queue/prefill/decode children), its
"request finished" log line, and its metrics, all from one `RequestRecord`."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from observability import names
from observability.metrics import ServingMetrics
from observability.tracing import context_from_carrier, inject_carrier, trace_id_hex

logger = logging.getLogger("affinity.requests")


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


@dataclass(slots=True)
class RequestSpan:
    span: trace.Span
    start_ns: int

    @property
    def carrier(self) -> dict[str, str]:
        """The W3C context to send downstream, so replica spans join this trace."""
        return inject_carrier(trace.set_span_in_context(self.span))


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
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)[:200]))
            raise
        finally:
            span.end()

    def finish(self, rs: RequestSpan, r: RequestRecord) -> None:
        """Attributes and phase children on the span, one log line, the request metrics."""
        end = time.time_ns()
        replica = ",".join(sorted(set(r.replica_ids)))
        span = rs.span
        span.set_attribute("output_tokens", r.num_output_tokens)
        span.set_attribute("cached_tokens", r.num_cached_tokens)
        span.set_attribute("replica", replica)
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

    def _phase_spans(self, rs: RequestSpan, r: RequestRecord, end: int, replica: str) -> None:
        """routing | queue | prefill | decode, laid back from the end with the replica's own timings."""
        decode_start = end - int(r.decode_s * 1e9)
        prefill_start = decode_start - int(r.prefill_s * 1e9)
        queue_start = max(rs.start_ns, prefill_start - int(r.queue_s * 1e9))
        prefill_start = max(prefill_start, queue_start)
        decode_start = max(decode_start, prefill_start)
        ctx = trace.set_span_in_context(rs.span)
        phases = ((names.SPAN_ROUTING, rs.start_ns, queue_start), (names.SPAN_QUEUE, queue_start, prefill_start),
                  (names.SPAN_PREFILL, prefill_start, decode_start), (names.SPAN_DECODE, decode_start, end))
        for name, a, b in phases:
            child = self.tracer.start_span(name, context=ctx, start_time=a, attributes={"replica": replica})
            child.end(end_time=max(a, b))
