"""The admin API: ``create_app(settings)`` builds the FastAPI application.

Every route under /api/v1 requires a bearer credential; /openapi.json, /docs,
/healthz and /metrics (Prometheus) are public; /console is the web console (its own login). On first start an admin key is written to the admin-token file.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from adaflash.config import Settings, load_config
from controlplane import auth, console, metrics
from controlplane.api import errors
from controlplane.api.deps import current_principal
from controlplane.api.routes import audit, evaluations, hold, keys, learners, nodes, tenants, versions
from controlplane.api.schemas import ErrorBody
from controlplane.db import database_url, make_engine, make_sessionmaker, upgrade
from controlplane.gates import load_policy
from controlplane.tracing import TracingMiddleware

log = logging.getLogger("adaflash.controlplane")
API_PREFIX = "/api/v1"

_ERRORS = {
    400: "malformed request (e.g. a body that is not JSON)",
    401: "missing or invalid credentials",
    403: "the caller's role or tenant scope does not allow this",
    404: "no such resource",
    409: "the action does not fit the resource's current state",
    422: "the request does not match the schema",
}
COMMON_RESPONSES = {code: {"model": ErrorBody, "description": text} for code, text in _ERRORS.items()}


def create_app(settings: Settings | None = None, *, migrate: bool = True) -> FastAPI:
    """Build the app: migrate the database, load the gate policy, make sure an admin key exists."""
    settings = settings or load_config()
    url = database_url(settings)
    if migrate:
        upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    jwt_secret = auth.jwt_secret(settings.controlplane)
    policy = load_policy(settings.controlplane.policy_file or None)
    token_path = auth.admin_token_path(settings)
    with sessions() as session:
        if auth.bootstrap_admin(session, token_path):
            log.warning("created the first admin key; it is in %s (mode 0600)", token_path)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.dispose()

    app = FastAPI(title="AdaFlash control plane", version="1", lifespan=lifespan,
                  description="Governed promotion of speculative-decoding drafters. Every /api/v1 route "
                              "needs 'Authorization: Bearer <API key or JWT>'.")
    app.state.settings, app.state.sessions, app.state.engine = settings, sessions, engine
    app.state.policy, app.state.jwt_secret = policy, jwt_secret
    errors.install(app)
    app.add_middleware(TracingMiddleware)

    api = APIRouter(prefix=API_PREFIX, dependencies=[Depends(current_principal)], responses=COMMON_RESPONSES)
    for router in (keys.me, versions.router, versions.promotions, evaluations.router, nodes.router,
                   tenants.router, tenants.deletions, audit.router, keys.router, learners.router, hold.router,
                   hold.learner_router):
        api.include_router(router)
    app.include_router(api)
    console.install(app)  # the web console at /console (same keys, roles and actions)

    @app.get("/healthz", include_in_schema=False)
    def healthz():
        return {"status": "ok"}

    metrics_registry = metrics.make_registry(sessions, settings)

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics():
        """Versions per state, approval wait, nodes, the learner's consumer lag (Prometheus text)."""
        return Response(metrics.render(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app
