"""OpenAI-compatible HTTP server of one node (FastAPI).

Requests are validated here (clear 4xx JSON errors, nothing reaches the engine that it
cannot serve), turned into ``Sequence`` objects and handed to the engine thread; tokens
come back through a thread-safe callback into an asyncio queue per request. A client
that goes away cancels its request at the next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaflash.contracts.serving import (
    TENANT_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    DrafterLoadRequest,
    SpeculativeUsage,
    Usage,
    error_body,
)
from adaflash.contracts.tenancy import DEFAULT_TENANT, TENANT_ID_RULE, valid_tenant_id
from dataplane.admission import install_quota_errors
from dataplane.drafter_io import DrafterLoadError
from dataplane.node import Node
from dataplane.sequence import SamplingParams, Sequence
from dataplane.tracing import TracingMiddleware, attach

log = logging.getLogger("adaflash.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _tenant(request: Request) -> str:
    tenant = request.headers.get(TENANT_HEADER, DEFAULT_TENANT).strip() or DEFAULT_TENANT
    if not valid_tenant_id(tenant):
        raise ApiError(400, f"{TENANT_HEADER} must be {TENANT_ID_RULE}", param=TENANT_HEADER)
    return tenant


def create_app(node: Node, admin_token: str) -> FastAPI:
    app = FastAPI(title="AdaFlash dataplane", version="1")
    app.state.node = node
    cfg = node.settings.dataplane
    metrics = node.engine.metrics
    app.add_middleware(TracingMiddleware, node=node)
    install_quota_errors(app, metrics)  # a tenant over its queue limit or token budget: 429 + Retry-After

    # --- errors -------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        metrics.rejected.labels(reason=e.code or str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        is_json = err.get("type") == "json_invalid"
        metrics.rejected.labels(reason="malformed_json" if is_json else "invalid").inc()
        msg = "request body is not valid JSON" if is_json else f"{'.'.join(loc) or 'body'}: {err.get('msg')}"
        return JSONResponse(error_body(msg, param=".".join(loc) or None,
                                       code="malformed_json" if is_json else "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), type_="not_found" if e.status_code == 404 else "http_error"),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_req, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error", type_="server_error"), status_code=500)

    # --- health --------------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        engine = node.engine
        alive = engine._thread is not None and engine._thread.is_alive()
        drafter_ok = engine.mode == "ar" or engine.drafter is not None
        ready = alive and drafter_ok
        body = {"ready": ready, "model": node.identity["id"], "drafter_version": engine.drafter_version,
                "mode": engine.mode, "engine_alive": alive}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        payload = metrics.render()
        if node.emitter is not None and getattr(node.emitter, "registry", None) is not None:
            payload += generate_latest(node.emitter.registry)
        return Response(payload, media_type="text/plain; version=0.0.4")

    # --- admin ---------------------------------------------------------------------------------------
    def _auth(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_token.encode()):
            raise ApiError(401, "missing or invalid bearer token", code="unauthorized", type_="authentication_error")

    @app.get("/admin/drafter")
    async def get_drafter(request: Request):
        _auth(request)
        return node.drafter_info()

    @app.post("/admin/drafter")
    async def post_drafter(request: Request):
        _auth(request)
        body = await _json(request)
        try:
            req = DrafterLoadRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            raise ApiError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}", code="invalid_value") from e
        try:
            result = await asyncio.to_thread(node.load_drafter, req.version, req.uri, req.sha256)
        except DrafterLoadError as e:
            raise ApiError(409, f"drafter refused, still serving {node.engine.drafter_version}: {e}",
                           code="drafter_refused") from e
        return result

    # --- completions ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        return await _serve(request, req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        text = node.tokenizer.apply_chat([m.model_dump() for m in req.messages])
        return await _serve(request, req, text, chat=True)

    async def _serve(request: Request, req, prompt_text: str, chat: bool):
        tenant = _tenant(request)
        ids = node.prompt_ids(prompt_text)
        if len(ids) > cfg.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(ids)} tokens; this node accepts at most {cfg.max_prompt_tokens}",
                           param="prompt" if not chat else "messages", code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else cfg.max_new_tokens_limit
        if max_tokens > cfg.max_new_tokens_limit:
            raise ApiError(400, f"max_tokens must be at most {cfg.max_new_tokens_limit}", param="max_tokens",
                           code="invalid_value")
        room = node.settings.model.max_model_len - len(ids)
        max_tokens = max(1, min(max_tokens, room))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        seq = Sequence(request_id=rid, prompt_ids=ids, tenant_id=tenant, domain=req.domain,
                       prompt_text=prompt_text,
                       params=SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=max_tokens,
                                             stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos))
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_update(s: Sequence, new: list[int], finished: bool) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (len(new), finished))

        seq.on_update = on_update
        detok = node.new_detokenizer(req.stop)
        attach(seq)
        node.engine.add(seq)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_stream(request, seq, q, detok, rid, created, chat),
                                     media_type="text/event-stream")
        try:
            text = await _collect(request, seq, q, detok)
        except asyncio.CancelledError:
            node.engine.cancel(rid)
            raise
        if seq.finish_reason == "error":
            raise ApiError(500, f"generation failed: {seq.error}", type_="server_error", code="engine_error")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": seq.finish_reason,
                   "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": seq.finish_reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": node.identity["id"], "choices": [choice], "usage": _usage(seq).model_dump()}

    async def _collect(request: Request, seq: Sequence, q: asyncio.Queue, detok) -> str:
        parts = []
        while True:
            try:
                _n, finished = await asyncio.wait_for(q.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    node.engine.cancel(seq.request_id)
                    return "".join(parts)
                continue
            parts.append(_delta(seq, detok, finished))
            if finished or detok.stopped:
                return "".join(parts)

    def _delta(seq: Sequence, detok, finished: bool) -> str:
        delta = detok.update(list(seq.output_ids), final=finished)
        if detok.stopped and not finished:
            seq.finish_reason = "stop"
            node.engine.cancel(seq.request_id)
        return delta

    async def _stream(request, seq, q, detok, rid, created, chat) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        model = node.identity["id"]

        def chunk(text: str | None, finish: str | None, usage: dict | None = None, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        first = True
        try:
            while True:
                _n, finished = await q.get()
                text = _delta(seq, detok, finished)
                done = finished or detok.stopped
                if text or first:
                    yield chunk(text, None, first=first)
                    first = False
                if done:
                    reason = "stop" if detok.stopped else seq.finish_reason
                    if reason == "error":
                        yield f"data: {json.dumps(error_body(f'generation failed: {seq.error}', 'server_error'))}\n\n".encode()
                    else:
                        yield chunk(None, reason, usage=_usage(seq).model_dump())
                    yield b"data: [DONE]\n\n"
                    return
        except asyncio.CancelledError:  # the client went away
            node.engine.cancel(rid)
            raise
        finally:
            if seq.finished_at is None:
                node.engine.cancel(rid)

    def _usage(seq: Sequence) -> Usage:
        st = seq.stats()
        return Usage(prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
                     total_tokens=len(seq.prompt_ids) + len(seq.output_ids),
                     speculative=SpeculativeUsage(drafter_version=seq.drafter_version, **st))

    return app


async def _json(request: Request):
    raw = await request.body()
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="malformed_json")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="malformed_json") from e


async def _parse(request: Request, model):
    body = await _json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="malformed_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise ApiError(400, f"{loc}: {err['msg']}", param=loc, code="invalid_value") from e
