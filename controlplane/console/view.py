"""What the console's pages and actions share: the caller, rendering, errors, role checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import RedirectResponse
from pydantic import ValidationError
from starlette.responses import Response

from controlplane.api.deps import ADMIN, APPROVE, READ, allow
from controlplane.auth import Principal
from controlplane.console import session as sess
from controlplane.errors import ControlPlaneError
from controlplane.states import Role

# Messages shown after an action (looked up by a fixed key, never echoed from the URL).
NOTICES = {
    "approved": "Approved: the rollout starts with the canary nodes.",
    "rejected": "Rejected.",
    "rolled_back": "Rollback started: the previous version serves again.",
    "pinned": "Pinned.",
    "unpinned": "Released.",
    "policy": "Tenant policy stored.",
    "deletion": "Deletion request created.",
    "hold": "Learning hold stored.",
    "logged_out": "Logged out.",
}


# Only this origin's own scripts, styles, images and form targets; never framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class NeedLogin(Exception):
    """No valid session: the page redirects to the login form."""


def caller(request: Request) -> sess.ConsoleSession:
    s = sess.load(request)
    if s.principal is None:
        raise NeedLogin()
    return s


def may(principal: Principal, roles: Iterable[Role]) -> bool:
    return principal.role in frozenset(roles)


def require(principal: Principal, roles: Iterable[Role]) -> None:
    """The API's own role check (raises Forbidden with the API's message)."""
    allow(*roles)(principal)


def render(request: Request, s: sess.ConsoleSession, template: str, status: int = 200, **ctx: Any) -> Response:
    me = s.principal
    can = {"read": bool(me) and may(me, READ), "approve": bool(me) and may(me, APPROVE),
           "admin": bool(me) and may(me, ADMIN), "audit": bool(me) and may(me, (Role.auditor, *READ))}
    notice = NOTICES.get(request.query_params.get("done", ""))
    resp = request.app.state.console_templates.TemplateResponse(
        request, template, {"me": me, "can": can, "csrf": s.csrf, "notice": notice, **ctx}, status_code=status)
    resp.headers.update(SECURITY_HEADERS)
    return sess.save(request, resp, s)


def error_page(request: Request, s: sess.ConsoleSession, status: int, message: str) -> Response:
    return render(request, s, "error.html", status=status, status_code=status, message=message)


def guard(request: Request, fn: Callable[[sess.ConsoleSession], Response]) -> Response:
    """Run a page or action as the logged-in caller: no session -> the login form; the API's
    refusals (and invalid input) -> an error page with their status."""
    try:
        s = caller(request)
    except NeedLogin:
        if request.method == "GET":
            return RedirectResponse(f"/console/login?next={quote(request.url.path)}", status_code=303)
        return error_page(request, sess.load(request), 401, "not logged in: log in with an API key")
    try:
        return fn(s)
    except ControlPlaneError as e:
        return error_page(request, s, e.status, e.message)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_page(request, s, 422, f"invalid input: {where}: {first.get('msg', 'invalid')}")


def db(request: Request):
    """A database session for one page (the API's get_session, outside dependency injection)."""
    return request.app.state.sessions()


def redirect(url: str, done: str | None = None) -> Response:
    return RedirectResponse(f"{url}?done={done}" if done else url, status_code=303)
