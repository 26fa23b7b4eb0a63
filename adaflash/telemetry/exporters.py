"""Exporters of spans and metrics to JSON-lines files, and where the OTLP and file exporters write."""


import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import (
    SpanExporter,
    SpanExportResult,
)


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
