"""OpenTelemetry for a serving node: one trace per completion request.

The span tree of a request::

    request                       (HTTP, from the first byte in to the last byte out)
    |-- queue                     (waiting for admission)
    |-- prefill                   (admission to the first token)
    |-- spec_round x N            (k_hat, accepted, a_hat; one per verify round)

``TracingMiddleware`` (pure ASGI, so the span covers streamed bodies too) opens the
``request`` span and makes it current; the server calls :func:`attach` when it hands
the request to the engine, which records the span's traceparent on the request envelope
(it travels with the feedback record into Kafka headers). Nothing runs on the engine
thread: the engine already timestamps arrival, prefill and every committed token, and
the child spans are built from those timestamps when the response is done, together
with the TTFT / inter-token / end-to-end latency histograms per tenant. With no
telemetry set up for the dataplane the middleware passes requests straight through.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from adaflash.contracts.serving import TENANT_HEADER
from adaflash.telemetry import DATAPLANE, SpanAttrs, Spans, current_telemetry, inject_traceparent

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_ROUND_SPANS = 256  # longer requests keep their first rounds as spans; all count in the attributes


@dataclass
class _Request:
    span: trace.Span
    tenant: str
    seq: object | None = None


_CURRENT: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("adaflash_request", default=None)


def attach(seq, envelope) -> None:
    """Tie a sequence to the current request span and record the span's traceparent on its
    envelope (call before ``engine.add``)."""
    req = _CURRENT.get()
    if req is None:
        return
    req.seq = seq
    req.span.set_attribute(SpanAttrs.REQUEST_ID, seq.request_id)
    req.span.set_attribute(SpanAttrs.TENANT, seq.tenant_id)
    envelope.traceparent = inject_traceparent(req.span) or None


class TracingMiddleware:
    """ASGI middleware: a ``request`` span around each completion request."""

    def __init__(self, app, node=None):
        self.app = app
        self.node = node

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in TRACED_PATHS:
            return await self.app(scope, receive, send)
        tel = current_telemetry(DATAPLANE)
        if tel is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        tenant = headers.get(TENANT_HEADER.lower(), "") or "default"
        attrs = {"http.request.method": scope.get("method", ""), "url.path": scope["path"], SpanAttrs.TENANT: tenant}
        if self.node is not None:
            attrs[SpanAttrs.NODE_ID] = self.node.node_id
            attrs[SpanAttrs.MODE] = self.node.engine.mode
        span = tel.tracer("adaflash.dataplane").start_span(Spans.REQUEST, kind=SpanKind.SERVER, attributes=attrs)
        req = _Request(span, tenant)
        token = otel_context.attach(trace.set_span_in_context(span))
        var_token = _CURRENT.set(req)
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
            _CURRENT.reset(var_token)
            otel_context.detach(token)
            try:
                finish(tel, req, status["code"])
            except Exception:  # telemetry must never break serving
                pass


def _groups(times: list[float]) -> list[tuple[float, int]]:
    """(timestamp, tokens) of each commit: the engine stamps all tokens of one commit alike."""
    out: list[tuple[float, int]] = []
    for t in times:
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def finish(tel, req: _Request, http_status: int) -> None:
    """Build the child spans and latency records of a finished request; end its span."""
    span = req.span
    span.set_attribute("http.response.status_code", http_status)
    seq = req.seq
    end_ns = time.time_ns()
    if seq is not None:
        offset = time.time_ns() - time.monotonic_ns()

        def ns(mono: float) -> int:
            return int(mono * 1e9) + offset

        ctx = trace.set_span_in_context(span)
        tracer = tel.tracer("adaflash.dataplane")
        arrival, prefill_at, first = seq.arrival, getattr(seq, "prefill_at", None), seq.first_token_at
        if prefill_at is not None:
            tracer.start_span(Spans.QUEUE, context=ctx, start_time=ns(arrival)).end(end_time=ns(prefill_at))
            if first is not None:
                tracer.start_span(Spans.PREFILL, context=ctx, start_time=ns(prefill_at),
                                  attributes={"prompt_tokens": len(seq.prompt_ids)}).end(end_time=ns(first))
        groups = _groups(list(seq.token_times))
        rounds = list(seq.rounds)
        if len(groups) == len(rounds) + 1:  # first commit is the prefill's token
            for i, r in enumerate(rounds[:MAX_ROUND_SPANS]):
                s = tracer.start_span(Spans.SPEC_ROUND, context=ctx, start_time=ns(groups[i][0]),
                                      attributes={SpanAttrs.K_HAT: int(r.k_hat), SpanAttrs.ACCEPTED: int(r.accepted),
                                                  "a_hat": float(r.a_hat), "round": i})
                s.end(end_time=ns(groups[i + 1][0]))
        st = seq.stats()
        span.set_attributes({
            SpanAttrs.DRAFTER_VERSION: seq.drafter_version or "none",
            "finish_reason": seq.finish_reason or "",
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "rounds": st["rounds"],
            "accepted_tokens": st["accepted_tokens"],
            "verified_tokens": st["verified_tokens"],
            "tau": float(st["mean_accept_len"]),
        })
        if seq.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, seq.error or "engine error"))
        # latencies (seconds): TTFT, per-token gaps (a commit's gap shared by its tokens), end to end
        itl: list[float] = []
        for (t_prev, _), (t, n) in zip(groups, groups[1:], strict=False):
            itl.extend([(t - t_prev) / n] * n)
        done = seq.finished_at or time.monotonic()
        if first is not None and seq.finish_reason != "error":
            tel.record_request_latency(seq.tenant_id, first - arrival, itl, done - arrival)
    if http_status >= 500:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {http_status}"))
    span.end(end_time=end_ns)
