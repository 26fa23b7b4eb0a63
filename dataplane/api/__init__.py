"""The serving node's HTTP app: ``create_app(node, admin_token)``.

Routers: ``openai`` (/v1/models, /v1/completions, /v1/chat/completions), ``admin``
(/admin/drafter, bearer token) and ``health`` (/healthz, /readyz, /metrics). Requests are
validated before they reach the engine (``deps``; errors in OpenAI's shape, ``errors``);
each completion becomes a ``generation.Generation`` of n engine sequences.
"""

from __future__ import annotations

from fastapi import FastAPI

from dataplane.admission import install_quota_errors
from dataplane.api import admin, deps, errors, health, openai
from dataplane.api.generation import InflightRequests
from dataplane.grammar import GrammarCompiler
from dataplane.node import Node
from dataplane.tracing import TracingMiddleware


def create_app(node: Node, admin_token: str) -> FastAPI:
    app = FastAPI(title="AdaFlash dataplane", version="1")
    app.state.node = node
    app.state.admin_token = admin_token
    app.state.grammars = GrammarCompiler(node.tokenizer, node.target.args.vocab_size)
    app.state.inflight = InflightRequests()
    app.add_middleware(TracingMiddleware, node=node)
    errors.install(app, on_reject=lambda code: node.engine.metrics.rejected.labels(reason=code).inc())
    install_quota_errors(app, node.engine.metrics)  # a tenant over its queue limit or token budget: 429
    for router in (openai.router, admin.router, health.router):
        app.include_router(router)
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Add the nested models of hand-parsed request bodies to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(deps.BODY_SCHEMAS)
        return app.openapi_schema

    app.openapi = openapi


__all__ = ["create_app"]
