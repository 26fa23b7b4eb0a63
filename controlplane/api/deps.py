"""Dependencies injected into the routes: settings, a database session, the caller."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from adaflash.config import Settings
from controlplane.auth import Principal, authenticate
from controlplane.errors import Forbidden, Unauthorized
from controlplane.gates import GatePolicy
from controlplane.states import Role

bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="An API key (adf_...) or, where configured, an HS256 JWT")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_policy(request: Request) -> GatePolicy:
    return request.app.state.policy


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; routes commit what they change, anything else rolls back."""
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()


def current_principal(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise Unauthorized("missing credentials: send 'Authorization: Bearer <API key or token>'")
    # Its own short session: authentication must not share a transaction with the action.
    with request.app.state.sessions() as session:
        return authenticate(session, creds.credentials, request.app.state.settings.controlplane,
                            request.app.state.jwt_secret)


def allow(*roles: Role) -> Callable[..., Principal]:
    """A dependency admitting only callers whose role is in ``roles``."""
    allowed = frozenset(roles)

    def dependency(principal: Principal = Depends(current_principal)) -> Principal:
        if principal.role not in allowed:
            names = ", ".join(sorted(r.value for r in allowed))
            raise Forbidden(f"role {principal.role.value} may not do this; it needs one of: {names}")
        return principal

    return dependency


READ = (Role.viewer, Role.approver, Role.admin)
APPROVE = (Role.approver, Role.admin)
ADMIN = (Role.admin,)
SessionDep = Depends(get_session)
