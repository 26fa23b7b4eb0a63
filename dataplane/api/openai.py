"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from adaflash.contracts.serving import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
)
from dataplane.api import bodies, deps
from dataplane.api.errors import ApiError
from dataplane.api.generation import Delta, Generation, InflightRequests
from dataplane.grammar import GrammarError
from dataplane.node import Node
from dataplane.sequence import SamplingParams

router = APIRouter(prefix="/v1", tags=["openai"])


def served_names(node: Node) -> set[str]:
    return {node.identity["id"], node.settings.model.target_id}


@router.get("/models", response_model=ModelList)
async def list_models(node: Node = Depends(deps.node)):
    return ModelList(data=[_card(node)])


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, node: Node = Depends(deps.node)):
    if model_id not in served_names(node):
        raise _unknown_model(node, model_id, param=None)
    return _card(node)


def _card(node: Node) -> ModelCard:
    info = node.drafter_info()
    return ModelCard(id=node.identity["id"], created=int(node.started_at), root=node.identity["id"],
                     max_model_len=node.settings.model.max_model_len,
                     drafter={"version": info["version"], "mode": info["mode"],
                              "manifest_sha256": info["manifest_sha256"], "block_size": info["block_size"]})


def _unknown_model(node: Node, name: str, param: str | None = "model") -> ApiError:
    return ApiError(404, f"model {name!r} does not exist on this node; it serves {node.identity['id']!r}",
                    param=param, code="model_not_found", type_="not_found_error")


@router.post("/completions", openapi_extra=deps.openapi_body(CompletionRequest))
async def completions(request: Request, req: CompletionRequest = Depends(deps.body_of(CompletionRequest)),
                      node: Node = Depends(deps.node), tenant: str = Depends(deps.tenant)):
    return await _serve(request, node, req, req.prompt, tenant, chat=False, top=req.logprobs)


@router.post("/chat/completions", openapi_extra=deps.openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request,
                           req: ChatCompletionRequest = Depends(deps.body_of(ChatCompletionRequest)),
                           node: Node = Depends(deps.node), tenant: str = Depends(deps.tenant)):
    text = node.tokenizer.apply_chat([m.model_dump() for m in req.messages])
    top = (req.top_logprobs or 0) if req.logprobs else None
    return await _serve(request, node, req, text, tenant, chat=True, top=top)


async def _grammar(request: Request, req):
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    try:
        return await asyncio.to_thread(request.app.state.grammars.compile, fmt.type, schema)
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format", code="invalid_schema") from e


async def _serve(request: Request, node: Node, req, prompt_text: str, tenant: str, chat: bool, top: int | None):
    inflight: InflightRequests = request.app.state.inflight
    key = inflight.open(request.url.path, tenant)
    handed_off = False
    try:
        resp = await _generate(request, node, req, prompt_text, tenant, chat, top, inflight, key)
        handed_off = isinstance(resp, StreamingResponse)
        return resp
    finally:
        if not handed_off:  # a stream leaves the registry when its last byte is out
            inflight.close(key)


async def _generate(request: Request, node: Node, req, prompt_text: str, tenant: str, chat: bool, top: int | None,
                    inflight: InflightRequests, key: int):
    cfg = node.settings.dataplane
    if req.model is not None and req.model not in served_names(node):
        raise _unknown_model(node, req.model)
    ids = node.prompt_ids(prompt_text)
    if len(ids) > cfg.max_prompt_tokens:
        raise ApiError(400, f"prompt has {len(ids)} tokens; this node accepts at most {cfg.max_prompt_tokens}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else cfg.max_new_tokens_limit
    if max_tokens > cfg.max_new_tokens_limit:
        raise ApiError(400, f"max_tokens must be at most {cfg.max_new_tokens_limit}", param="max_tokens",
                       code="invalid_value")
    if node.engine.load["waiting"] + req.n > cfg.max_waiting:
        raise ApiError(429, f"this node has {node.engine.load['waiting']} requests waiting; retry later",
                       code="overloaded", type_="rate_limit_error")
    room = node.settings.model.max_model_len - len(ids)
    params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=max(1, min(max_tokens, room)),
                            stop=req.stop or [], seed=req.seed, ignore_eos=req.ignore_eos, logprobs=top,
                            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                            grammar=await _grammar(request, req))
    gen = Generation(node, ids, prompt_text, tenant, params, req.n, req.domain, chat)
    inflight.stage(key, "queueing", gen)
    gen.start()
    inflight.stage(key, "generating")
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(request, node, gen, chat, usage, lambda: inflight.close(key)),
                                 media_type="text/event-stream")
    try:
        texts = await _collect(request, gen)
    except asyncio.CancelledError:
        gen.cancel()
        raise
    if gen.error is not None:
        raise ApiError(500, f"generation failed: {gen.error}", type_="server_error", code="engine_error")
    choices = [_choice(node, gen, i, texts[i], chat) for i in range(len(gen.choices))]
    return {"id": gen.id, "object": "chat.completion" if chat else "text_completion", "created": gen.created,
            "model": node.identity["id"], "choices": choices, "usage": bodies.usage(len(ids), gen.seqs)}


async def _collect(request: Request, gen: Generation) -> list[str]:
    parts: list[list[str]] = [[] for _ in gen.choices]
    async for d in gen.deltas(request):
        parts[d.choice.index].append(d.text)
    return ["".join(p) for p in parts]


def _choice(node: Node, gen: Generation, i: int, text: str, chat: bool) -> dict:
    c = gen.choices[i]
    lp = None
    if c.seq.params.logprobs is not None:
        lp = (bodies.chat_logprobs(node.tokenizer, c.seq.logprobs) if chat
              else bodies.completion_logprobs(node.tokenizer, c.seq.logprobs, [], 0))
    if chat:
        return {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": c.finish_reason,
                "logprobs": lp}
    return {"index": i, "text": text, "finish_reason": c.finish_reason, "logprobs": lp}


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def _stream(request: Request, node: Node, gen: Generation, chat: bool, include_usage: bool,
                  on_close=None) -> AsyncIterator[bytes]:
    head = {"id": gen.id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.created, "model": node.identity["id"]}
    extra = {"usage": None} if include_usage else {}
    started: set[int] = set()
    try:
        async for d in gen.deltas(request):
            if d.finish_reason == "error":
                yield _sse(error_body(f"generation failed: {gen.error}", "server_error", code="engine_error"))
                yield b"data: [DONE]\n\n"
                return
            first = d.choice.index not in started
            if d.text or d.logprobs or first:
                started.add(d.choice.index)
                yield _sse({**head, "choices": [_chunk_choice(node, d, chat, first, None)], **extra})
            if d.finish_reason is not None:
                yield _sse({**head, "choices": [_chunk_choice(node, Delta(d.choice, ""), chat, False,
                                                              d.finish_reason)], **extra})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": bodies.usage(len(gen.prompt_ids), gen.seqs)})
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:  # the client went away
        gen.cancel()
        raise
    finally:
        gen.cancel()
        if on_close is not None:
            on_close()


def _chunk_choice(node: Node, d: Delta, chat: bool, first: bool, finish: str | None) -> dict:
    lp = None
    if d.choice.seq.params.logprobs is not None and d.logprobs:
        if chat:
            lp = bodies.chat_logprobs(node.tokenizer, d.logprobs)
        else:
            offset0 = len(node.tokenizer.decode(d.ids_before))
            lp = bodies.completion_logprobs(node.tokenizer, d.logprobs, d.ids_before, offset0)
    if chat:
        delta = {"role": "assistant", "content": d.text} if first else ({"content": d.text} if d.text else {})
        return {"index": d.choice.index, "delta": delta, "finish_reason": finish, "logprobs": lp}
    return {"index": d.choice.index, "text": d.text, "finish_reason": finish, "logprobs": lp}
