"""W3C trace context across Kafka headers and HTTP: inject, extract, link."""


from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from adaflash.contracts import HEADER_TRACEPARENT

_PROPAGATOR = TraceContextTextMapPropagator()


def _as_context(source: Span | SpanContext | Context | None) -> Context | None:
    if source is None:
        return None  # the current context
    if isinstance(source, SpanContext):
        return trace.set_span_in_context(NonRecordingSpan(source), Context())
    if isinstance(source, Span):
        return trace.set_span_in_context(source, Context())
    if isinstance(source, Context):
        return source
    raise TypeError(f"expected a Span, SpanContext or Context, got {type(source).__name__}")


def inject_traceparent(source: Span | SpanContext | Context | None = None) -> str:
    """The W3C traceparent of ``source`` (default: the current span); "" when none is valid."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=_as_context(source))
    return carrier.get("traceparent", "")


def extract_context(traceparent: str | bytes | None) -> Context:
    """A context whose parent is the span named by ``traceparent``.

    Use it as ``start_as_current_span(name, context=extract_context(tp))``. An empty or
    malformed value gives an empty context, so the new span starts a new trace.
    """
    if isinstance(traceparent, bytes | bytearray | memoryview):
        traceparent = bytes(traceparent).decode("ascii", errors="replace")
    if not traceparent:
        return Context()
    return _PROPAGATOR.extract({"traceparent": traceparent.strip()}, context=Context())


def traceparent_header(source: Span | SpanContext | Context | None = None) -> list[tuple[str, bytes]]:
    """Kafka headers carrying the traceparent: ``[("traceparent", b"00-...")]`` or ``[]``."""
    tp = inject_traceparent(source)
    return [(HEADER_TRACEPARENT, tp.encode("ascii"))] if tp else []


def traceparent_from_headers(headers: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> str | None:
    """The traceparent in Kafka record headers (a list of (key, bytes) or a mapping)."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    for key, value in items:
        if isinstance(key, bytes):
            key = key.decode("ascii", errors="replace")
        if key.lower() == HEADER_TRACEPARENT:
            if value is None:
                return None
            if isinstance(value, bytes | bytearray | memoryview):
                return bytes(value).decode("ascii", errors="replace")
            return str(value)
    return None


def context_from_headers(headers: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> Context:
    """The parent context carried by Kafka record headers (empty when absent)."""
    return extract_context(traceparent_from_headers(headers))


def links_from_traceparents(traceparents: Iterable[str | bytes | None],
                            attributes: Mapping[str, Any] | None = None, limit: int = 128) -> list[Link]:
    """Span links to the traces of many records (one training step uses a whole buffer)."""
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    for tp in traceparents:
        sc = trace.get_current_span(extract_context(tp)).get_span_context()
        if not sc.is_valid or (sc.trace_id, sc.span_id) in seen:
            continue
        seen.add((sc.trace_id, sc.span_id))
        links.append(Link(sc, attributes))
        if len(links) >= limit:
            break
    return links
