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

import json
import os
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from adaflash import __version__
from adaflash.contracts import HEADER_TRACEPARENT

__all__ = [
    "CONTROLPLANE",
    "DATAPLANE",
    "LEARNER",
    "SERVICES",
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

# service.name of each service.
DATAPLANE = "adaflash-dataplane"
LEARNER = "adaflash-learner"
CONTROLPLANE = "adaflash-controlplane"
SERVICES = (DATAPLANE, LEARNER, CONTROLPLANE)
SERVICE_NAMESPACE = "adaflash"


class Spans:
    """Span names, fixed here and nowhere else."""

    # dataplane
    REQUEST = "request"  # one HTTP completion request, root of its trace
    QUEUE = "queue"  # waiting for admission
    PREFILL = "prefill"
    SPEC_ROUND = "spec_round"  # attributes k_hat, accepted
    SCRUB = "scrub"  # PII scrubbing of the feedback record
    PRODUCE = "produce"  # feedback record to Kafka (or the spool)
    # learner
    TRAIN_STEP = "train_step"
    PUBLISH = "publish"  # candidate to MLflow
    # control plane
    SHADOW_EVALUATION = "shadow_evaluation"
    GATE = "gate"
    ROLLOUT = "rollout"

    ALL = (REQUEST, QUEUE, PREFILL, SPEC_ROUND, SCRUB, PRODUCE, TRAIN_STEP, PUBLISH,
           SHADOW_EVALUATION, GATE, ROLLOUT)


class SpanAttrs:
    """Attribute names used on spans and metrics."""

    TENANT = "tenant"
    K_HAT = "k_hat"
    ACCEPTED = "accepted"
    REQUEST_ID = "request_id"
    RECORD_ID = "record_id"
    NODE_ID = "node_id"
    MODE = "mode"
    DRAFTER_VERSION = "drafter_version"
    VERSION = "version"  # a registry version (candidate, champion)
    RECORDS = "records"  # how many feedback records a step used
    DECISION = "decision"  # a gate's or a rollout's outcome


class Metrics:
    """OpenTelemetry instrument names (seconds; attribute ``tenant``)."""

    TTFT = "adaflash.request.ttft"
    INTER_TOKEN_LATENCY = "adaflash.request.inter_token_latency"
    E2E_LATENCY = "adaflash.request.e2e_latency"

    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
    E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# --------------------------------------------------------------------------- exporters


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as one flat JSON-able dict (ids as W3C hex strings)."""
    ctx = span.context
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "kind": span.kind.name,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {
                "trace_id": _hex(link.context.trace_id, 32),
                "span_id": _hex(link.context.span_id, 16),
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
        "service": (span.resource.attributes.get("service.name") if span.resource else None),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else None,
    }


class _JsonLinesFile:
    """Appends JSON lines to a file; one ``open`` per batch, so rotation is harmless."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._closed = False

    def write(self, rows: Iterable[dict[str, Any]]) -> bool:
        if self._closed:
            return False
        text = "".join(json.dumps(r, default=str, separators=(",", ":")) + "\n" for r in rows)
        if not text:
            return True
        try:
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._closed = True


class FileSpanExporter(SpanExporter):
    """Writes finished spans as JSON lines (see :func:`span_to_dict`)."""

    def __init__(self, path: str | os.PathLike):
        self._file = _JsonLinesFile(path)

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = self._file.write(span_to_dict(s) for s in spans)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FileMetricExporter(MetricExporter):
    """Writes each metrics collection as one JSON line (OTLP-JSON-like structure)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self._file = _JsonLinesFile(path)

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        ok = self._file.write([json.loads(metrics_data.to_json(indent=None))])
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._file.close()


def _otlp_urls(endpoint: str) -> tuple[str | None, str | None]:
    """(traces URL, metrics URL) from a collector base URL or a full signal URL."""
    endpoint = endpoint.strip()
    if not endpoint:
        return None, None  # the exporters read OTEL_EXPORTER_OTLP_* or use localhost:4318
    for suffix in ("/v1/traces", "/v1/metrics"):
        if endpoint.endswith(suffix):
            endpoint = endpoint[: -len(suffix)]
            break
    base = endpoint.rstrip("/")
    return base + "/v1/traces", base + "/v1/metrics"


def _file_paths(settings: Any, service_name: str) -> tuple[Path, Path]:
    configured = settings.telemetry.file_path
    if configured:
        traces = Path(configured.replace("{service}", service_name))
    else:
        traces = Path(settings.home) / f"traces-{service_name}.jsonl"
    name = traces.name
    metrics_name = name.replace("traces", "metrics", 1) if "traces" in name else f"metrics-{name}"
    if metrics_name == name:  # pragma: no cover - defensive
        metrics_name = f"metrics-{name}"
    return traces, traces.with_name(metrics_name)


# --------------------------------------------------------------------------- telemetry


@dataclass
class Telemetry:
    """One service's providers and instruments; hand it to the code that needs it."""

    service_name: str
    exporter: str
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    span_exporter: SpanExporter | None = None
    metric_reader: MetricReader | None = None
    traces_path: Path | None = None
    metrics_path: Path | None = None
    _instruments: dict[str, Any] = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        meter = self.meter("adaflash")
        self._instruments = {
            "ttft": meter.create_histogram(
                Metrics.TTFT, unit="s", description="Time to first token per request",
                explicit_bucket_boundaries_advisory=Metrics.TTFT_BUCKETS),
            "itl": meter.create_histogram(
                Metrics.INTER_TOKEN_LATENCY, unit="s", description="Time between streamed tokens",
                explicit_bucket_boundaries_advisory=Metrics.ITL_BUCKETS),
            "e2e": meter.create_histogram(
                Metrics.E2E_LATENCY, unit="s", description="End-to-end request latency",
                explicit_bucket_boundaries_advisory=Metrics.E2E_BUCKETS),
        }

    # -- accessors
    def tracer(self, name: str = "adaflash") -> trace.Tracer:
        return self.tracer_provider.get_tracer(name, __version__)

    def meter(self, name: str = "adaflash"):
        return self.meter_provider.get_meter(name, __version__)

    @property
    def memory_exporter(self) -> InMemorySpanExporter | None:
        """The in-memory span exporter (exporter ``memory`` or one passed in), else None."""
        return self.span_exporter if isinstance(self.span_exporter, InMemorySpanExporter) else None

    def finished_spans(self) -> list[ReadableSpan]:
        """Spans finished so far (in-memory exporter only)."""
        exp = self.memory_exporter
        if exp is None:
            raise RuntimeError(f"telemetry exporter is {self.exporter!r}, not an in-memory one")
        return list(exp.get_finished_spans())

    def metrics_data(self) -> MetricsData | None:
        """Collect metrics now (in-memory metric reader only)."""
        if isinstance(self.metric_reader, InMemoryMetricReader):
            return self.metric_reader.get_metrics_data()
        raise RuntimeError(f"telemetry exporter is {self.exporter!r}, not an in-memory one")

    # -- metrics
    def record_request_latency(self, tenant: str, ttft_s: float | None, itl_s_list: Iterable[float] | None,
                               e2e_s: float | None, attributes: Mapping[str, Any] | None = None) -> None:
        """Record one finished request's TTFT, inter-token gaps and end-to-end latency."""
        attrs: dict[str, Any] = {SpanAttrs.TENANT: tenant or "unknown"}
        if attributes:
            attrs.update(attributes)
        if ttft_s is not None and ttft_s >= 0:
            self._instruments["ttft"].record(float(ttft_s), attrs)
        for gap in itl_s_list or ():
            if gap is not None and gap >= 0:
                self._instruments["itl"].record(float(gap), attrs)
        if e2e_s is not None and e2e_s >= 0:
            self._instruments["e2e"].record(float(e2e_s), attrs)

    # -- lifecycle
    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        ok = self.tracer_provider.force_flush(timeout_millis)
        try:
            ok = self.meter_provider.force_flush(timeout_millis) and ok
        except Exception:  # a metric exporter that cannot reach its endpoint
            ok = False
        return ok

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.tracer_provider.shutdown()
        finally:
            self.meter_provider.shutdown()
        with _LOCK:
            if _REGISTRY.get(self.service_name) is self:
                del _REGISTRY[self.service_name]
            global _LAST
            if _LAST is self:
                _LAST = next(reversed(_REGISTRY.values()), None)


_LOCK = threading.RLock()
_REGISTRY: dict[str, Telemetry] = {}
_LAST: Telemetry | None = None
_GLOBAL_SET = False


def setup_telemetry(service_name: str, settings: Any, *, span_exporter: SpanExporter | None = None,
                    metric_reader: MetricReader | None = None, set_global: bool = False,
                    resource_attributes: Mapping[str, Any] | None = None) -> Telemetry:
    """Configure traces and metrics for ``service_name`` from ``settings.telemetry``.

    ``settings`` is an :class:`adaflash.config.Settings` (anything with ``.home`` and
    ``.telemetry`` works). ``span_exporter`` / ``metric_reader`` override the configured
    exporter (tests pass one shared ``InMemorySpanExporter`` to several services). The
    result becomes the current telemetry of that service, replacing (and shutting down)
    an earlier one. ``set_global=True`` also installs the providers as the
    OpenTelemetry globals, once per process, for third-party instrumentation.
    """
    tcfg = settings.telemetry
    kind = tcfg.exporter
    attrs: dict[str, Any] = {
        "service.name": service_name,
        "service.namespace": SERVICE_NAMESPACE,
        "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
    }
    if resource_attributes:
        attrs.update(resource_attributes)
    resource = Resource.create(attrs)
    sampler = ParentBased(TraceIdRatioBased(float(getattr(tcfg, "sample_ratio", 1.0))))
    tracer_provider = TracerProvider(resource=resource, sampler=sampler)
    interval_ms = max(1.0, float(getattr(tcfg, "metrics_interval_s", 60.0))) * 1000.0

    traces_path = metrics_path = None
    readers: list[MetricReader] = []
    exporter: SpanExporter | None = span_exporter
    if exporter is not None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "memory":
        exporter = InMemorySpanExporter()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "console":
        exporter = ConsoleSpanExporter(service_name=service_name)
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "file":
        traces_path, metrics_path = _file_paths(settings, service_name)
        exporter = FileSpanExporter(traces_path)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        traces_url, _ = _otlp_urls(tcfg.otlp_endpoint)
        exporter = OTLPSpanExporter(endpoint=traces_url)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    elif kind != "none":
        raise ValueError(f"unknown telemetry exporter {kind!r}")

    if metric_reader is not None:
        readers.append(metric_reader)
    elif kind == "memory" or (span_exporter is not None and kind in ("memory", "none")):
        readers.append(InMemoryMetricReader())
    elif kind == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval_ms))
    elif kind == "file":
        readers.append(PeriodicExportingMetricReader(FileMetricExporter(metrics_path),
                                                     export_interval_millis=interval_ms))
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        _, metrics_url = _otlp_urls(tcfg.otlp_endpoint)
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=metrics_url),
                                                     export_interval_millis=interval_ms))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)

    tel = Telemetry(service_name=service_name, exporter=kind, tracer_provider=tracer_provider,
                    meter_provider=meter_provider, span_exporter=exporter,
                    metric_reader=readers[0] if readers else None,
                    traces_path=traces_path, metrics_path=metrics_path)
    global _LAST, _GLOBAL_SET
    with _LOCK:
        previous = _REGISTRY.get(service_name)
        _REGISTRY[service_name] = tel
        _LAST = tel
        if set_global and not _GLOBAL_SET:
            from opentelemetry import metrics as otel_metrics

            trace.set_tracer_provider(tracer_provider)
            otel_metrics.set_meter_provider(meter_provider)
            _GLOBAL_SET = True
    if previous is not None and previous is not tel:
        previous.shutdown()
    return tel


def get_telemetry(service_name: str) -> Telemetry | None:
    """The current telemetry of one service, if it was set up in this process."""
    with _LOCK:
        return _REGISTRY.get(service_name)


def current_telemetry(service: str | None = None) -> Telemetry | None:
    """The telemetry of ``service``, else the one set up last in this process."""
    with _LOCK:
        return _REGISTRY.get(service) if service else _LAST


def reset_telemetry() -> None:
    """Shut down every service's telemetry set up in this process (test teardown)."""
    with _LOCK:
        all_tel = list(_REGISTRY.values())
    for tel in all_tel:
        tel.shutdown()
    global _LAST
    with _LOCK:
        _REGISTRY.clear()
        _LAST = None


_NOOP_TRACER = trace.NoOpTracer()


class _ProxyTracer(trace.Tracer):
    """Resolves the service's current provider at each span start."""

    def __init__(self, name: str, service: str | None):
        self._name = name
        self._service = service
        self._cache: tuple[Telemetry, trace.Tracer] | None = None

    def _real(self) -> trace.Tracer:
        tel = current_telemetry(self._service)
        if tel is None:
            return _NOOP_TRACER
        cached = self._cache
        if cached is not None and cached[0] is tel:
            return cached[1]
        real = tel.tracer(self._name)
        self._cache = (tel, real)
        return real

    def start_span(self, *args, **kwargs) -> Span:
        return self._real().start_span(*args, **kwargs)

    def start_as_current_span(self, *args, **kwargs):
        return self._real().start_as_current_span(*args, **kwargs)


def tracer(name: str = "adaflash", service: str | None = None) -> trace.Tracer:
    """A tracer for instrumentation scope ``name`` of ``service`` (default: the last set up)."""
    return _ProxyTracer(name, service)


def record_request_latency(tenant: str, ttft_s: float | None, itl_s_list: Iterable[float] | None,
                           e2e_s: float | None, *, service: str | None = None,
                           attributes: Mapping[str, Any] | None = None) -> None:
    """Record request latencies on the current telemetry (no-op before setup)."""
    tel = current_telemetry(service)
    if tel is not None:
        tel.record_request_latency(tenant, ttft_s, itl_s_list, e2e_s, attributes)


# --------------------------------------------------------------------------- propagation

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
