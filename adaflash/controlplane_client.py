"""A typed client of the control plane's admin API (``/api/v1``), over httpx.

Every method returns the API's own models (``adaflash.contracts.admin_api``,
``adaflash.contracts.tenancy``) and raises ``ControlPlaneError`` carrying the API's
error body ({"error", "message", "details"}) and the HTTP status when a call fails, or
``ControlPlaneUnreachable`` when no answer came at all.

Where the CLI finds the control plane and its key (``resolve_url`` / ``resolve_token``):
the URL from ``--url``, else ``$ADAFLASH_CONTROLPLANE_URL``, else the running embedded
stack's state file (``adaflash status --json``), else ``dataplane.controlplane_url``,
else ``http://controlplane.host:controlplane.port``; the key from ``$ADAFLASH_TOKEN``,
else the admin-token file the control plane writes (``controlplane.admin_token_file``,
default ``$ADAFLASH_HOME/admin-token``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from adaflash import credentials
from adaflash.config import Settings
from adaflash.contracts.admin_api import (
    ApproveIn,
    AuditEntryOut,
    AuditVerifyOut,
    ClaimsIn,
    ClaimsOut,
    DeletionAckIn,
    DeletionIn,
    DeletionOut,
    DeletionScope,
    DesiredOut,
    EvaluationOut,
    HeartbeatIn,
    HeartbeatOut,
    HoldIn,
    HoldOut,
    KeyCreated,
    KeyIn,
    NodeOut,
    NodeRole,
    NodeUpdate,
    PinIn,
    PinOut,
    PromotionOut,
    ReasonIn,
    Role,
    TenantPolicyIn,
    VersionDetail,
    VersionOut,
    WhoAmI,
)
from adaflash.contracts.tenancy import TenantPolicy

API_PREFIX = "/api/v1"
TOKEN_ENV = "ADAFLASH_TOKEN"
URL_ENV = "ADAFLASH_CONTROLPLANE_URL"
T = TypeVar("T")


class ControlPlaneError(Exception):
    """The admin API refused a call: ``status`` (HTTP), ``code`` and ``message`` from its error body."""

    def __init__(self, status: int | None, code: str, message: str, details: list | None = None):
        super().__init__(f"{message} (HTTP {status}, {code})" if status else message)
        self.status, self.code, self.message, self.details = status, code, message, details or []


class ControlPlaneUnreachable(ControlPlaneError):
    """No answer from the control plane (connection refused, timeout, DNS)."""


class ControlPlaneClient:
    """``ControlPlaneClient(url, token)``; ``url`` is the control plane's base URL (with or
    without ``/api/v1``). Use as a context manager, or call ``close()``."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None):
        base = url.rstrip("/")
        if base.endswith(API_PREFIX):
            base = base[: -len(API_PREFIX)]
        self.base_url = base
        headers = {"Authorization": f"Bearer {token}"} if token else {}  # no key: the API answers 401
        self.http = httpx.Client(base_url=base + API_PREFIX, timeout=timeout_s, transport=transport, headers=headers)

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- plumbing --------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, params: dict | None = None,
                 body: BaseModel | None = None) -> httpx.Response:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        json = body.model_dump(mode="json") if body is not None else None
        try:
            r = self.http.request(method, path, params=params, json=json)
        except httpx.HTTPError as e:
            raise ControlPlaneUnreachable(None, "unreachable",
                                          f"control plane at {self.base_url} unreachable: {e}") from e
        if r.status_code >= 400:
            raise _error(r)
        return r

    def _call(self, kind: type[T] | Any, method: str, path: str, **kw) -> T:
        return TypeAdapter(kind).validate_python(self._request(method, path, **kw).json())

    # -- who am I ---------------------------------------------------------------------------------------------
    def whoami(self) -> WhoAmI:
        return self._call(WhoAmI, "GET", "/whoami")

    # -- versions ---------------------------------------------------------------------------------------------
    def list_versions(self, state: str | None = None, limit: int = 100, offset: int = 0) -> list[VersionOut]:
        return self._call(list[VersionOut], "GET", "/versions",
                          params={"state": state, "limit": limit, "offset": offset})

    def get_version(self, version: str) -> VersionDetail:
        return self._call(VersionDetail, "GET", f"/versions/{_seg(version)}")

    def approve(self, version: str, reason: str = "") -> VersionDetail:
        return self._call(VersionDetail, "POST", f"/versions/{_seg(version)}/approve", body=ApproveIn(reason=reason))

    def reject(self, version: str, reason: str) -> VersionDetail:
        return self._call(VersionDetail, "POST", f"/versions/{_seg(version)}/reject", body=ReasonIn(reason=reason))

    def rollback(self, version: str, reason: str) -> PromotionOut:
        return self._call(PromotionOut, "POST", f"/versions/{_seg(version)}/rollback",
                          body=ReasonIn(reason=reason))

    def pin(self, version: str, reason: str, node_ids: Sequence[str] = ()) -> PinOut:
        return self._call(PinOut, "POST", f"/versions/{_seg(version)}/pin",
                          body=PinIn(node_ids=list(node_ids), reason=reason))

    def unpin(self, version: str, reason: str, node_ids: Sequence[str] = ()) -> PinOut:
        return self._call(PinOut, "POST", f"/versions/{_seg(version)}/unpin",
                          body=PinIn(node_ids=list(node_ids), reason=reason))

    def list_promotions(self, active: bool = False, limit: int = 100) -> list[PromotionOut]:
        return self._call(list[PromotionOut], "GET", "/promotions", params={"active": active, "limit": limit})

    # -- evaluations ------------------------------------------------------------------------------------------
    def list_evaluations(self, version: str | None = None, limit: int = 50) -> list[EvaluationOut]:
        return self._call(list[EvaluationOut], "GET", "/evaluations", params={"version": version, "limit": limit})

    def get_evaluation(self, evaluation_id: int) -> EvaluationOut:
        return self._call(EvaluationOut, "GET", f"/evaluations/{int(evaluation_id)}")

    def plot(self, evaluation_id: int, name: str) -> bytes:
        """One plot of an evaluation report, as PNG bytes."""
        return self._request("GET", f"/evaluations/{int(evaluation_id)}/plots/{_seg(name)}").content

    # -- nodes ------------------------------------------------------------------------------------------------
    def list_nodes(self) -> list[NodeOut]:
        return self._call(list[NodeOut], "GET", "/nodes")

    def get_node(self, node_id: str) -> NodeOut:
        return self._call(NodeOut, "GET", f"/nodes/{_seg(node_id)}")

    def set_node_role(self, node_id: str, role: NodeRole | str) -> NodeOut:
        """Make a node a canary or a regular node (admin)."""
        return self._call(NodeOut, "PUT", f"/nodes/{_seg(node_id)}", body=NodeUpdate(role=NodeRole(role)))

    def desired(self, node_id: str) -> DesiredOut | None:
        """The drafter version the node should serve; None: it keeps serving what it has."""
        return self._call(DesiredOut | None, "GET", f"/nodes/{_seg(node_id)}/desired")

    def heartbeat(self, node_id: str, beat: HeartbeatIn) -> HeartbeatOut:
        """A node's heartbeat (node role); the answer names the version it should serve."""
        return self._call(HeartbeatOut, "POST", f"/nodes/{_seg(node_id)}/heartbeat", body=beat)

    # -- tenants ----------------------------------------------------------------------------------------------
    def list_tenants(self) -> list[TenantPolicy]:
        return self._call(list[TenantPolicy], "GET", "/tenants")

    def get_tenant_policy(self, tenant_id: str) -> TenantPolicy:
        return self._call(TenantPolicy, "GET", f"/tenants/{_seg(tenant_id)}/policy")

    def set_tenant_policy(self, tenant_id: str, **fields: Any) -> TenantPolicy:
        """Store a tenant's policy; fields not given keep their current values."""
        current = self.get_tenant_policy(tenant_id).model_dump(exclude={"tenant_id"})
        body = TenantPolicyIn(**{**current, **fields})
        return self._call(TenantPolicy, "PUT", f"/tenants/{_seg(tenant_id)}/policy", body=body)

    def audit(self, tenant_id: str | None = None, action: str | None = None, after_seq: int = 0,
              limit: int = 100) -> list[AuditEntryOut]:
        """Audit entries in order (a tenant's trail with ``tenant_id``)."""
        return self._call(list[AuditEntryOut], "GET", "/audit",
                          params={"tenant_id": tenant_id, "action": action, "after_seq": after_seq, "limit": limit})

    def verify_audit(self) -> AuditVerifyOut:
        return self._call(AuditVerifyOut, "GET", "/audit/verify")

    # -- deletion requests ------------------------------------------------------------------------------------
    def request_deletion(self, tenant_id: str, reason: str, scope: DeletionScope | str = DeletionScope.tenant,
                         ids: Sequence[str] = ()) -> DeletionOut:
        body = DeletionIn(tenant_id=tenant_id, scope=DeletionScope(scope), ids=list(ids), reason=reason)
        return self._call(DeletionOut, "POST", "/deletion-requests", body=body)

    def get_deletion(self, request_id: int) -> DeletionOut:
        return self._call(DeletionOut, "GET", f"/deletion-requests/{int(request_id)}")

    def deletion_work(self, instance: str) -> list[DeletionOut]:
        """Open requests the node or learner ``instance`` has not acknowledged yet (its work list)."""
        return self._call(list[DeletionOut], "GET", "/deletion-requests", params={"instance": instance, "state": "open"})

    def ack_deletion(self, request_id: int, ack: DeletionAckIn) -> DeletionOut:
        """Report that a component purged the request's tenant from its stores."""
        return self._call(DeletionOut, "POST", f"/deletion-requests/{int(request_id)}/ack", body=ack)

    def list_deletions(self, tenant_id: str | None = None, state: str | None = None,
                       limit: int = 100) -> list[DeletionOut]:
        return self._call(list[DeletionOut], "GET", "/deletion-requests",
                          params={"tenant_id": tenant_id, "state": state, "limit": limit})

    # -- learners ---------------------------------------------------------------------------------------------
    def claim_records(self, learner_id: str, claim: Sequence[str], trained: Sequence[str] = ()) -> ClaimsOut:
        """Claim the records a learner is about to train; report those it trained (learner role)."""
        return self._call(ClaimsOut, "POST", f"/learners/{_seg(learner_id)}/claims",
                          body=ClaimsIn(claim=list(claim), trained=list(trained)))

    def learner_hold(self, learner_id: str) -> HoldOut:
        """A learner reads the learning hold between two steps (learner role; the read is remembered)."""
        return self._call(HoldOut, "GET", f"/learners/{_seg(learner_id)}/hold")

    # -- the learning hold ------------------------------------------------------------------------------------
    def get_hold(self) -> HoldOut:
        return self._call(HoldOut, "GET", "/hold")

    def set_hold(self, learning: bool, evaluation: bool, reason: str) -> HoldOut:
        """Pause (True) or resume (False) online training and shadow evaluation (admin)."""
        return self._call(HoldOut, "PUT", "/hold", body=HoldIn(learning=learning, evaluation=evaluation, reason=reason))

    # -- keys (admin) -----------------------------------------------------------------------------------------
    def create_key(self, name: str, role: Role | str, tenants: Sequence[str] = (),
                   node_id: str | None = None) -> KeyCreated:
        body = KeyIn(name=name, role=Role(role), tenants=list(tenants), node_id=node_id)
        return self._call(KeyCreated, "POST", "/keys", body=body)


def _seg(value: str) -> str:
    """One path segment, escaped (a version or id never changes the route)."""
    from urllib.parse import quote

    return quote(str(value), safe="")


def _error(r: httpx.Response) -> ControlPlaneError:
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "message" in body:
        return ControlPlaneError(r.status_code, str(body.get("error", "error")), str(body["message"]),
                                 body.get("details"))
    return ControlPlaneError(r.status_code, "http_error", f"HTTP {r.status_code}: {r.text[:200]}")


# -- where the control plane and the key are -----------------------------------------------------------------
def resolve_url(settings: Settings, url: str | None = None) -> str:
    """The control plane's base URL (see the module docstring for the order)."""
    if url:
        return url
    if os.environ.get(URL_ENV, "").strip():
        return os.environ[URL_ENV].strip()
    from adaflash.stack_state import live_status

    state = live_status(settings)
    stack_url = (state.get("endpoints") or {}).get("controlplane_url")
    if state.get("running") and stack_url:
        return stack_url
    if settings.dataplane.controlplane_url:
        return settings.dataplane.controlplane_url
    cp = settings.controlplane
    host = "127.0.0.1" if cp.host in ("0.0.0.0", "::", "") else cp.host
    return f"http://{host}:{cp.port}"


def token_path(settings: Settings) -> Path:
    """The admin-token file the control plane writes on first start."""
    return credentials.controlplane_admin(settings).path


def resolve_token(settings: Settings, token: str | None = None) -> str:
    """The API key to send: explicit, ``$ADAFLASH_TOKEN``, or the admin-token file; raises if none."""
    if token:
        return token
    cred = credentials.controlplane_admin(settings)
    found = credentials.lookup(credentials.Credential(cred.name, TOKEN_ENV, cred.files))
    if not found:
        raise ControlPlaneError(None, "no_credentials",
                                f"no API key: set ${TOKEN_ENV} or pass --token-file (no admin key at {cred.path})")
    return found
