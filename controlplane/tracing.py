"""OpenTelemetry for the control plane's admin API: a server span per request.

:class:`TracingMiddleware` (pure ASGI) opens a span ``<METHOD> <route>`` (route template
with its router prefixes) around every request, continuing the caller's trace when it
sends a ``traceparent``. The workers' spans (``shadow_evaluation``, ``gate``,
``rollout``) are made where the work happens (controlplane/shadow/, rollout.py).
A no-op until ``setup_telemetry(CONTROLPLANE, settings)`` ran in the process.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from adaflash.telemetry import CONTROLPLANE, current_telemetry, extract_context, tracer

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
