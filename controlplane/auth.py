"""Who is calling: API keys (salted hashes in the database), optional HS256 JWTs, roles.

A key reads ``adf_<key_id>_<secret>``: ``key_id`` finds the row, the secret is checked
against its salted HMAC-SHA256 in constant time. Roles: viewer < approver < admin for
operators; auditor reads only its tenants; node may heartbeat, read its desired version
and read tenant policies; node and learner keys list the deletion requests awaiting
them and acknowledge them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jwt
from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash import credentials
from adaflash.config import ControlplaneConfig, Settings
from controlplane import audit
from controlplane.db import utcnow
from controlplane.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized
from controlplane.models import ApiKey
from controlplane.states import Role

KEY_PREFIX = "adf"
OPERATOR_RANK = {Role.viewer: 1, Role.approver: 2, Role.admin: 3}
READERS = frozenset({Role.viewer, Role.approver, Role.admin})
APPROVERS = frozenset({Role.approver, Role.admin})
ADMINS = frozenset({Role.admin})


@dataclass(frozen=True)
class Principal:
    kind: str  # key | jwt | system
    subject: str  # key id, JWT subject or system component
    name: str
    role: Role
    tenants: tuple[str, ...] = ()  # auditor scope
    node_id: str | None = None  # node keys: the node they speak for (learner keys: the learner id)

    @property
    def actor(self) -> str:
        """How the audit log names this caller."""
        return f"{self.kind}:{self.subject}" + (f" ({self.name})" if self.name else "")

    def may_read_tenant(self, tenant_id: str) -> bool:
        if self.role == Role.auditor:
            return tenant_id in self.tenants
        return self.role in READERS or self.role in (Role.node, Role.learner)

    def tenant_scope(self) -> list[str] | None:
        """Tenants this caller may see, or None for all."""
        return list(self.tenants) if self.role == Role.auditor else None


SYSTEM = Principal("system", "controlplane", "", Role.admin)


def require_tenant(principal: Principal, tenant_id: str) -> None:
    if not principal.may_read_tenant(tenant_id):
        raise Forbidden(f"{principal.role.value} key is not scoped to tenant {tenant_id!r}")


def visible_tenants(principal: Principal, tenant_id: str | None) -> list[str] | None:
    """Tenants a listing may show: the one asked for (if allowed), else the caller's scope
    (None: all)."""
    if tenant_id is not None:
        require_tenant(principal, tenant_id)
        return [tenant_id]
    return principal.tenant_scope()


def require_node(principal: Principal, node_id: str) -> None:
    """A bound node (or learner) key speaks only for its own node id (learner id)."""
    if principal.role in (Role.node, Role.learner) and principal.node_id and principal.node_id != node_id:
        raise Forbidden(f"this {principal.role.value} key speaks for {principal.node_id!r}, not {node_id!r}")


# -- API keys ------------------------------------------------------------------------------
def hash_secret(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


def _parse_key(token: str) -> tuple[str, str] | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def _key_view(k: ApiKey) -> dict:
    return {"key_id": k.key_id, "name": k.name, "role": k.role, "tenants": list(k.tenants or []),
            "node_id": k.node_id, "expires_at": k.expires_at, "revoked_at": k.revoked_at}


def create_key(session: Session, *, name: str, role: Role, actor: str, tenants: list[str] | None = None,
               node_id: str | None = None, expires_at: datetime | None = None) -> tuple[ApiKey, str]:
    """Store a new key; returns the row and the plaintext key (shown once, never stored)."""
    role = Role(role)
    tenants = sorted(set(tenants or []))
    if role == Role.auditor and not tenants:
        raise Invalid("an auditor key needs at least one tenant in its scope")
    if role != Role.auditor and tenants:
        raise Invalid("only auditor keys carry a tenant scope")
    if node_id and role not in (Role.node, Role.learner):
        raise Invalid("only node keys (and learner keys, to a learner id) are bound to a node")
    key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_hex(16)
    row = ApiKey(key_id=key_id, name=name, role=role.value, tenants=tenants, node_id=node_id, salt=salt,
                 secret_hash=hash_secret(salt, secret), created_by=actor, created_at=utcnow(),
                 expires_at=expires_at)
    session.add(row)
    session.flush()
    audit.record(session, actor=actor, action="key.create", target=f"key:{key_id}", after=_key_view(row))
    return row, f"{KEY_PREFIX}_{key_id}_{secret}"


def revoke_key(session: Session, key_id: str, *, actor: str) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFound(f"key {key_id!r} not found")
    if row.revoked_at is not None:
        return row
    if row.role == Role.admin and _active_admins(session) <= 1:
        raise Conflict("cannot revoke the last active admin key")
    before = _key_view(row)
    row.revoked_at = utcnow()
    audit.record(session, actor=actor, action="key.revoke", target=f"key:{key_id}", before=before,
                 after=_key_view(row))
    return row


def _active_admins(session: Session) -> int:
    now = utcnow()
    rows = session.scalars(select(ApiKey).where(ApiKey.role == Role.admin.value, ApiKey.revoked_at.is_(None)))
    return sum(1 for r in rows if r.expires_at is None or r.expires_at > now)


def authenticate_key(session: Session, token: str, now: datetime | None = None) -> Principal:
    parsed = _parse_key(token)
    if parsed is None:
        raise Unauthorized("malformed API key")
    key_id, secret = parsed
    row = session.get(ApiKey, key_id)
    # Compare even when the key is unknown, so timing does not reveal which ids exist.
    expected = row.secret_hash if row else hash_secret("00" * 16, "")
    salt = row.salt if row else "00" * 16
    if not hmac.compare_digest(hash_secret(salt, secret), expected) or row is None:
        raise Unauthorized("invalid API key")
    now = now or utcnow()
    if row.revoked_at is not None:
        raise Unauthorized("API key revoked")
    if row.expires_at is not None and row.expires_at <= now:
        raise Unauthorized("API key expired")
    return Principal("key", row.key_id, row.name, Role(row.role), tuple(row.tenants or ()), row.node_id)


# -- JWT ---------------------------------------------------------------------------------------
def jwt_secret(cfg: ControlplaneConfig) -> str | None:
    """The HS256 secret when JWTs are configured; raises if the issuer is set but not the secret."""
    if not cfg.jwt_issuer:
        return None
    secret = credentials.lookup(credentials.jwt_secret(cfg))
    if not secret:
        raise RuntimeError(f"jwt_issuer is set but neither ${cfg.jwt_secret_env} nor "
                           f"controlplane.jwt_secret_file holds a secret")
    return secret


def authenticate_jwt(token: str, cfg: ControlplaneConfig, secret: str | None) -> Principal:
    if not secret:
        raise Unauthorized("JWT authentication is not configured; use an API key")
    try:
        claims = jwt.decode(token, secret, algorithms=["HS256"], issuer=cfg.jwt_issuer,
                            audience=cfg.jwt_audience, leeway=cfg.jwt_leeway_s,
                            options={"require": ["exp", "iss", "aud", "sub"]})
    except jwt.ExpiredSignatureError as e:
        raise Unauthorized("token expired") from e
    except jwt.InvalidTokenError as e:
        raise Unauthorized(f"invalid token: {e}") from e
    try:
        role = Role(claims.get("role"))
    except ValueError as e:
        raise Unauthorized("token carries no valid role claim") from e
    tenants = claims.get("tenants") or []
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise Unauthorized("token's tenants claim must be a list of strings")
    if role == Role.auditor and not tenants:
        raise Unauthorized("auditor token carries no tenants")
    return Principal("jwt", str(claims["sub"]), str(claims.get("name", "")), role, tuple(tenants),
                     claims.get("node_id"))


def authenticate(session: Session, token: str, cfg: ControlplaneConfig, secret: str | None) -> Principal:
    """A bearer token is a JWT when it has three dot-separated parts, else an API key."""
    if token.count(".") == 2:
        return authenticate_jwt(token, cfg, secret)
    return authenticate_key(session, token)


# -- first start ---------------------------------------------------------------------------------
def admin_token_path(settings: Settings) -> Path:
    return credentials.controlplane_admin(settings).path


def bootstrap_admin(session: Session, token_path: Path) -> bool:
    """On first start (no admin key ever created) create one and write it to ``token_path``
    with mode 0600, and commit. Returns whether a key was created. The key is never logged."""
    exists = session.scalar(select(ApiKey.key_id).where(ApiKey.role == Role.admin.value).limit(1))
    if exists:
        return False
    _, plaintext = create_key(session, name="bootstrap-admin", role=Role.admin, actor=SYSTEM.actor)
    # File first, then commit: a failed commit leaves no key behind, and we remove the file.
    credentials.write_private(token_path, plaintext + "\n")
    try:
        session.commit()
    except BaseException:
        token_path.unlink(missing_ok=True)
        raise
    return True
