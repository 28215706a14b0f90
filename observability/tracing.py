"""W3C trace-context helpers: extract from HTTP headers, carry as a dict through handles, re-attach."""
from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    return _propagator.extract(carrier={k.lower(): v for k, v in headers.items()})


def inject_carrier(ctx: otel_context.Context | None = None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def context_from_carrier(carrier: Mapping[str, str] | None) -> otel_context.Context:
    return _propagator.extract(carrier=dict(carrier or {}))


def trace_id_hex(span: trace.Span) -> str:
    return format(span.get_span_context().trace_id, "032x")
