"""Per-service tracer and meter providers: setup, registry, and the proxy tracer modules keep."""


import os
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
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
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span

from adaflash import __version__
from adaflash.telemetry.exporters import FileMetricExporter, FileSpanExporter, _file_paths, _otlp_urls
from adaflash.telemetry.names import (
    SERVICE_NAMESPACE,
    Metrics,
    SpanAttrs,
)


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
