"""The console's form posts: log in and out, approve, reject, roll back, pin, tenant policy, deletion,
the learning hold.

Every post checks the session's CSRF token, then the API's role check, then calls the
API's route function, which validates the body, acts, audits and commits.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from starlette.responses import Response

from controlplane.api.deps import ADMIN, APPROVE
from controlplane.api.routes import hold, tenants, versions
from controlplane.api.schemas import ApproveIn, DeletionIn, HoldIn, PinIn, ReasonIn, TenantPolicyIn
from controlplane.auth import authenticate
from controlplane.console import session as sess
from controlplane.console.pages import TenantPath, VersionPath
from controlplane.console.view import error_page, guard, redirect, render, require
from controlplane.errors import ControlPlaneError
from controlplane.states import DeletionScope

router = APIRouter(prefix="/console", include_in_schema=False)
Csrf = Annotated[str, Form(max_length=64)]
FormText = Annotated[str, Form(max_length=2000)]


@router.post("/login")
def login(request: Request, api_key: Annotated[str, Form(max_length=4096)], csrf: Csrf,
          next: Annotated[str, Form(max_length=512)] = "/console") -> Response:
    s = sess.load(request)
    try:
        sess.check_csrf(request, s, csrf)
        with request.app.state.sessions() as db:
            principal = authenticate(db, api_key.strip(), request.app.state.settings.controlplane,
                                     request.app.state.jwt_secret)
    except ControlPlaneError as e:
        return render(request, s, "login.html", status=e.status, next="/console", error=e.message)
    # A fresh CSRF token with every login: a token seen before the login is worth nothing after it.
    fresh = sess.ConsoleSession(csrf=sess.secrets.token_hex(16), key=api_key.strip(), principal=principal)
    return sess.save(request, redirect(next if next.startswith("/console") and "//" not in next else "/console"), fresh)


@router.post("/logout")
def logout(request: Request, csrf: Csrf) -> Response:
    s = sess.load(request)
    try:
        sess.check_csrf(request, s, csrf)
    except ControlPlaneError as e:
        return error_page(request, s, e.status, e.message)
    resp = redirect("/console/login", "logged_out")
    resp.delete_cookie(sess.COOKIE, path=sess.COOKIE_PATH)
    return resp


def _version_action(request: Request, version: str, csrf: str, roles, act, done: str) -> Response:
    def run(s: sess.ConsoleSession) -> Response:
        sess.check_csrf(request, s, csrf)
        require(s.principal, roles)
        with request.app.state.sessions() as db:
            act(db, s)
        return redirect(f"/console/versions/{version}", done)

    return guard(request, run)


@router.post("/versions/{version}/approve")
def approve(request: Request, version: VersionPath, csrf: Csrf, reason: FormText = "") -> Response:
    return _version_action(request, version, csrf, APPROVE, lambda db, s: versions.approve(
        version=version, body=ApproveIn(reason=reason), session=db, policy=request.app.state.policy, who=s.principal), "approved")


@router.post("/versions/{version}/reject")
def reject(request: Request, version: VersionPath, csrf: Csrf, reason: FormText = "") -> Response:
    return _version_action(request, version, csrf, APPROVE, lambda db, s: versions.reject(
        version=version, body=ReasonIn(reason=reason), session=db, who=s.principal), "rejected")


@router.post("/versions/{version}/rollback")
def rollback(request: Request, version: VersionPath, csrf: Csrf, reason: FormText = "") -> Response:
    return _version_action(request, version, csrf, APPROVE, lambda db, s: versions.rollback(
        version=version, body=ReasonIn(reason=reason), session=db, who=s.principal), "rolled_back")


def _node_ids(text: str) -> list[str]:
    return [n.strip() for n in text.replace(",", " ").split() if n.strip()]


@router.post("/versions/{version}/pin")
def pin(request: Request, version: VersionPath, csrf: Csrf, reason: FormText = "", nodes: FormText = "") -> Response:
    return _version_action(request, version, csrf, ADMIN, lambda db, s: versions.pin(
        version=version, body=PinIn(node_ids=_node_ids(nodes), reason=reason), session=db, who=s.principal), "pinned")


@router.post("/versions/{version}/unpin")
def unpin(request: Request, version: VersionPath, csrf: Csrf, reason: FormText = "",
          nodes: FormText = "") -> Response:
    return _version_action(request, version, csrf, ADMIN, lambda db, s: versions.unpin(
        version=version, body=PinIn(node_ids=_node_ids(nodes), reason=reason), session=db, who=s.principal), "unpinned")


@router.post("/tenants/{tenant_id}/policy")
def put_policy(request: Request, tenant_id: TenantPath, csrf: Csrf, sampling_rate: Annotated[float, Form()],
               ttl_days: Annotated[float, Form()], share_cap: Annotated[float, Form()],
               opt_out: Annotated[bool, Form()] = False) -> Response:
    def run(s: sess.ConsoleSession) -> Response:
        sess.check_csrf(request, s, csrf)
        require(s.principal, ADMIN)
        body = TenantPolicyIn(sampling_rate=sampling_rate, opt_out=opt_out, ttl_days=ttl_days, share_cap=share_cap)
        with request.app.state.sessions() as db:
            tenants.put_policy(tenant_id=tenant_id, body=body, session=db, who=s.principal)
        return redirect(f"/console/tenants/{tenant_id}", "policy")

    return guard(request, run)


@router.post("/deletions")
def create_deletion(request: Request, csrf: Csrf, tenant_id: Annotated[str, Form(max_length=128)],
                    reason: FormText = "", scope: Annotated[str, Form(max_length=16)] = "tenant",
                    ids: FormText = "") -> Response:
    def run(s: sess.ConsoleSession) -> Response:
        sess.check_csrf(request, s, csrf)
        require(s.principal, ADMIN)
        body = DeletionIn(tenant_id=tenant_id, scope=DeletionScope(scope) if scope in DeletionScope.__members__
                          else scope, ids=_node_ids(ids), reason=reason)
        with request.app.state.sessions() as db:
            tenants.create_deletion(body=body, session=db, settings=request.app.state.settings, who=s.principal)
        return redirect("/console/deletions", "deletion")

    return guard(request, run)


@router.post("/hold")
def put_hold(request: Request, csrf: Csrf, reason: FormText = "", learning: Annotated[bool, Form()] = False,
             evaluation: Annotated[bool, Form()] = False) -> Response:
    def run(s: sess.ConsoleSession) -> Response:
        sess.check_csrf(request, s, csrf)
        require(s.principal, ADMIN)
        body = HoldIn(learning=learning, evaluation=evaluation, reason=reason)
        with request.app.state.sessions() as db:
            hold.put_hold(body=body, session=db, who=s.principal)
        return redirect("/console/nodes", "hold")

    return guard(request, run)
