"""OpenTelemetry for the control plane: a span per API request and per worker action.

- :class:`TracingMiddleware` (pure ASGI) opens a server span ``<METHOD> <route>`` around
  every request (continuing the caller's trace when it sends a ``traceparent``).
- :func:`traced` decorates a lifecycle function with a span (``gate``, ``rollout``) whose
  attributes name the version and the outcome.
- :func:`worker_span` is the context manager the background workers use (``shadow_evaluation``
  and the others), optionally continuing a trace from a stored traceparent.

All of it is a no-op until ``setup_telemetry(CONTROLPLANE, settings)`` ran in the process.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from adaflash.telemetry import CONTROLPLANE, SpanAttrs, current_telemetry, extract_context, tracer

_tracer = tracer("adaflash.controlplane", service=CONTROLPLANE)


class TracingMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or current_telemetry(CONTROLPLANE) is None:
            return await self.app(scope, receive, send)
        method = scope.get("method", "")
        tp = None
        for k, v in scope.get("headers") or ():
            if k.lower() == b"traceparent":
                tp = v.decode("latin-1")
        parent = extract_context(tp) if tp else None
        span = _tracer.start_span(f"{method} {scope.get('path', '')}", context=parent, kind=SpanKind.SERVER,
                                  attributes={"http.request.method": method, "url.path": scope.get("path", "")})
        token = otel_context.attach(trace.set_span_in_context(span))
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException as e:
            span.record_exception(e)
            raise
        finally:
            otel_context.detach(token)
            route = _route(scope)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status["code"])
            if status["code"] >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status['code']}"))
            span.end()


def _route(scope) -> str | None:
    """The matched route template with the prefixes of its routers (``/api/v1/versions/{version}``)."""
    route = getattr(scope.get("route"), "path", None)
    if not route:
        return None
    path = scope.get("path", "")
    rsegs, psegs = route.strip("/").split("/"), path.strip("/").split("/")
    if len(psegs) > len(rsegs) and ":path}" not in route:
        prefix = "/".join(psegs[: len(psegs) - len(rsegs)])
        if not route.startswith("/" + prefix + "/"):
            route = f"/{prefix}{route}"
    return route


@contextlib.contextmanager
def worker_span(name: str, traceparent: str | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """A span for a background action; ``traceparent`` continues an earlier trace."""
    ctx = extract_context(traceparent) if traceparent else None
    attrs = {k: v for k, v in attributes.items() if v is not None}
    with _tracer.start_as_current_span(name, context=ctx, attributes=attrs) as span:
        yield span


def traced(name: str, outcome: Callable[[Any], Mapping[str, Any]] | None = None):
    """Decorate ``fn(session, version_or_promotion, ...)`` with a span named ``name``;
    ``outcome(result)`` adds attributes from the result (e.g. the gate decision)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            target = args[1] if len(args) > 1 else kwargs.get("version") or kwargs.get("p")
            version = getattr(target, "version", target)
            with _tracer.start_as_current_span(name, attributes={SpanAttrs.VERSION: str(version),
                                                                 "action": fn.__name__}) as span:
                result = fn(*args, **kwargs)
                if outcome is not None:
                    with contextlib.suppress(Exception):
                        span.set_attributes({k: v for k, v in outcome(result).items() if v is not None})
                return result

        return inner

    return wrap


def gate_outcome(results) -> dict[str, Any]:
    failed = [r.name for r in results if not r.passed]
    return {SpanAttrs.DECISION: "failed" if failed else "passed", "failed_gates": ",".join(failed) or None,
            "gates": len(results)}


def promotion_outcome(p) -> dict[str, Any]:
    return {SpanAttrs.DECISION: getattr(p, "state", None), "kind": getattr(p, "kind", None)}
