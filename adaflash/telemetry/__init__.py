"""OpenTelemetry traces and metrics for every AdaFlash service.

One call per process sets things up::

    from adaflash.telemetry import DATAPLANE, Spans, setup_telemetry, tracer

    tel = setup_telemetry(DATAPLANE, settings)          # settings.telemetry picks the exporter
    with tracer(__name__, service=DATAPLANE).start_as_current_span(Spans.REQUEST) as span:
        ...
    tel.record_request_latency("acme", ttft_s=0.12, itl_s_list=[0.03, 0.04], e2e_s=1.3)

Design notes:

- ``setup_telemetry`` builds its *own* ``TracerProvider`` and ``MeterProvider`` and
  returns them inside a :class:`Telemetry`; the OpenTelemetry globals are left alone
  unless ``set_global=True`` (they can be set only once per process, which would make
  tests order-dependent). Setting up the same service again shuts the previous one
  down and replaces it, so tests may call it as often as they like;
  :func:`reset_telemetry` clears everything.
- :func:`tracer` returns a proxy that resolves the service's current provider on every
  span, so a module may keep ``_tracer = tracer(__name__, service=...)`` at import time
  and still follow a later (re-)setup. With no service given it uses the last service
  set up in the process (in production, the only one). Before any setup it is a no-op.
- Trace context crosses Kafka as a W3C ``traceparent`` header (bytes value, header
  name from :mod:`adaflash.contracts`): :func:`traceparent_header` on the producer,
  :func:`context_from_headers` or :func:`extract_context` on the consumer. A training
  step that uses many records links to them (:func:`links_from_traceparents`); a
  per-record span can be a true child (``context=extract_context(tp)``).
- Span and attribute names are fixed in :class:`Spans` and :class:`SpanAttrs`.
"""

from __future__ import annotations

from adaflash.telemetry.exporters import FileMetricExporter, FileSpanExporter, span_to_dict
from adaflash.telemetry.names import (
    CONTROLPLANE,
    DATAPLANE,
    LEARNER,
    SERVICE_NAMESPACE,
    SERVICES,
    Metrics,
    SpanAttrs,
    Spans,
)
from adaflash.telemetry.propagation import (
    context_from_headers,
    extract_context,
    inject_traceparent,
    links_from_traceparents,
    traceparent_from_headers,
    traceparent_header,
)
from adaflash.telemetry.providers import (
    Telemetry,
    current_telemetry,
    get_telemetry,
    record_request_latency,
    reset_telemetry,
    setup_telemetry,
    tracer,
)

__all__ = [
    "CONTROLPLANE",
    "DATAPLANE",
    "LEARNER",
    "SERVICES",
    "SERVICE_NAMESPACE",
    "FileSpanExporter",
    "FileMetricExporter",
    "Metrics",
    "SpanAttrs",
    "Spans",
    "Telemetry",
    "context_from_headers",
    "current_telemetry",
    "extract_context",
    "get_telemetry",
    "inject_traceparent",
    "links_from_traceparents",
    "record_request_latency",
    "reset_telemetry",
    "setup_telemetry",
    "span_to_dict",
    "traceparent_from_headers",
    "traceparent_header",
    "tracer",
]
