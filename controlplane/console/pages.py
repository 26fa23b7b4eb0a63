"""The console's pages (GET): versions, one version, nodes (and the learning hold), tenants, deletions
and the audit log.

Each page reads through the admin API's route functions, after the API's role check.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from controlplane.api.deps import ADMIN, APPROVE, READ
from controlplane.api.routes import audit, evaluations, hold, nodes, tenants, versions
from controlplane.api.routes.evaluations import PLOT_PATTERN
from controlplane.api.schemas import ID_PATTERN, VERSION_PATTERN
from controlplane.console import session as sess
from controlplane.console.view import guard, may, redirect, render, require
from controlplane.states import Role

router = APIRouter(prefix="/console", include_in_schema=False)
VersionPath = Annotated[str, Path(pattern=VERSION_PATTERN)]
TenantPath = Annotated[str, Path(pattern=ID_PATTERN)]
EvaluationPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
AUDITORS = (Role.auditor, *READ)
PENDING = ("registered", "evaluating", "awaiting_approval", "approved", "canary")


@router.get("")
@router.get("/")
def home(request: Request) -> Response:
    s = sess.load(request)
    if s.principal is None:
        return redirect("/console/login")
    return redirect("/console/versions" if may(s.principal, READ) else "/console/tenants")


@router.get("/login")
def login_form(request: Request, next: str = "/console") -> Response:
    s = sess.load(request)
    return render(request, s, "login.html", next=next if next.startswith("/console") else "/console", error=None)


@router.get("/versions")
def versions_page(request: Request, state: str | None = None) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, READ)
        with request.app.state.sessions() as db:
            rows = versions.list_versions(state=None, limit=200, offset=0, session=db, _=s.principal)
        if state:
            rows = [v for v in rows if v.state == state]
        return render(request, s, "versions.html", versions=rows, state=state, pending=PENDING)

    return guard(request, page)


def _live(node_rows, version: str) -> list:
    """Nodes serving ``version`` now, with the live tau they report (the prediction's check)."""
    return [n for n in node_rows if n.served_version == version]


@router.get("/versions/{version}")
def version_page(request: Request, version: VersionPath) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, READ)
        settings = request.app.state.settings
        with request.app.state.sessions() as db:
            detail = versions.get_version(version=version, session=db, _=s.principal)
            evals = [evaluations.get_evaluation(evaluation_id=i, session=db, _=s.principal) for i in detail.evaluation_ids]
            node_rows = nodes.list_nodes(session=db, settings=settings, _=s.principal)
        latest = evals[-1] if evals else None
        return render(request, s, "version.html", v=detail, evaluation=latest, report=(latest.report or {})
                      if latest else {}, evaluations=evals, serving=_live(node_rows, version),
                      may_approve=may(s.principal, APPROVE), may_rollback=may(s.principal, APPROVE),
                      may_pin=may(s.principal, ADMIN), awaiting=detail.state == "awaiting_approval",
                      nodes=node_rows)

    return guard(request, page)


@router.get("/evaluations/{evaluation_id}/plots/{name}")
def plot(request: Request, evaluation_id: EvaluationPath,
         name: Annotated[str, Path(pattern=PLOT_PATTERN)]) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, READ)
        with request.app.state.sessions() as db:
            return evaluations.get_plot(evaluation_id=evaluation_id, name=name, session=db,
                                        settings=request.app.state.settings, _=s.principal)

    return guard(request, page)


@router.get("/nodes")
def nodes_page(request: Request) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, READ)
        with request.app.state.sessions() as db:
            rows = nodes.list_nodes(session=db, settings=request.app.state.settings, _=s.principal)
            held = hold.get_hold(session=db, who=s.principal)
        return render(request, s, "nodes.html", nodes=rows, hold=held, may_hold=may(s.principal, ADMIN))

    return guard(request, page)


@router.get("/tenants")
def tenants_page(request: Request, tenant: Annotated[str | None, Query(pattern=ID_PATTERN)] = None) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, AUDITORS)
        if tenant:
            return redirect(f"/console/tenants/{tenant}")
        with request.app.state.sessions() as db:
            rows = tenants.list_tenants(session=db, who=s.principal)
        return render(request, s, "tenants.html", tenants=rows, scope=s.principal.tenant_scope())

    return guard(request, page)


@router.get("/tenants/{tenant_id}")
def tenant_page(request: Request, tenant_id: TenantPath) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, AUDITORS)
        settings = request.app.state.settings
        with request.app.state.sessions() as db:
            policy = tenants.get_policy(tenant_id=tenant_id, session=db, settings=settings, who=s.principal)
            trail = audit.list_audit(after_seq=0, limit=500, action=None, tenant_id=tenant_id, session=db,
                                     who=s.principal)
            deletions = _deletions(db, settings, s, tenant_id)
        return render(request, s, "tenant.html", policy=policy, trail=trail, deletions=deletions,
                      may_edit=may(s.principal, ADMIN))

    return guard(request, page)


def _deletions(db, settings, s: sess.ConsoleSession, tenant_id: str | None) -> list:
    return tenants.list_deletions(tenant_id=tenant_id, state=None, component=None, instance=None, limit=200, offset=0,
                                  session=db, settings=settings, who=s.principal)


@router.get("/deletions")
def deletions_page(request: Request) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, AUDITORS)
        settings = request.app.state.settings
        with request.app.state.sessions() as db:
            rows = _deletions(db, settings, s, None)
            chain = audit.verify(session=db, _=s.principal)
        return render(request, s, "deletions.html", deletions=rows, chain=chain, may_request=may(s.principal, ADMIN))

    return guard(request, page)


@router.get("/audit")
def audit_page(request: Request) -> Response:
    def page(s: sess.ConsoleSession) -> Response:
        require(s.principal, AUDITORS)
        with request.app.state.sessions() as db:
            chain = audit.verify(session=db, _=s.principal)
            entries = audit.list_audit(after_seq=max(0, chain.entries - 200), limit=200, action=None, tenant_id=None,
                                       session=db, who=s.principal)
        return render(request, s, "audit.html", chain=chain, entries=list(reversed(entries)))

    return guard(request, page)
