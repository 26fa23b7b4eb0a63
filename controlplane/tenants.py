"""Tenant policies (``adaflash.contracts.tenancy.TenantPolicy``) and deletion requests."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash.config import GovernanceConfig
from adaflash.contracts.tenancy import TenantPolicy
from controlplane import audit
from controlplane.db import utcnow
from controlplane.errors import NotFound
from controlplane.models import DeletionRequest, Tenant
from controlplane.states import DeletionScope
from governance.policy import default_policy


def _policy(row: Tenant) -> TenantPolicy:
    return TenantPolicy(tenant_id=row.tenant_id, sampling_rate=row.sampling_rate, opt_out=row.opt_out,
                        ttl_days=row.ttl_days, share_cap=row.share_cap, weight=row.weight,
                        max_queued=row.max_queued, max_tokens=row.max_tokens)


def get_policy(session: Session, tenant_id: str, gov: GovernanceConfig) -> TenantPolicy:
    """The stored policy, or the configured defaults for a tenant nobody has configured."""
    row = session.get(Tenant, tenant_id)
    return _policy(row) if row else default_policy(tenant_id, gov)


def list_policies(session: Session, tenant_ids: list[str] | None = None) -> list[TenantPolicy]:
    q = select(Tenant).order_by(Tenant.tenant_id)
    if tenant_ids is not None:
        q = q.where(Tenant.tenant_id.in_(tenant_ids))
    return [_policy(r) for r in session.scalars(q)]


def put_policy(session: Session, policy: TenantPolicy, *, actor: str) -> TenantPolicy:
    now = utcnow()
    row = session.get(Tenant, policy.tenant_id)
    before = _policy(row).model_dump() if row else None
    if row is None:
        row = Tenant(tenant_id=policy.tenant_id, created_at=now)
        session.add(row)
    row.sampling_rate, row.opt_out = policy.sampling_rate, policy.opt_out
    row.ttl_days, row.share_cap, row.updated_at = policy.ttl_days, policy.share_cap, now
    row.weight, row.max_queued, row.max_tokens = policy.weight, policy.max_queued, policy.max_tokens
    audit.record(session, actor=actor, action="tenant.policy", target=f"tenant:{policy.tenant_id}",
                 tenant_id=policy.tenant_id, before=before, after=policy.model_dump(), at=now)
    return policy


def create_deletion(session: Session, *, tenant_id: str, scope: DeletionScope, ids: list[str], reason: str,
                    actor: str) -> DeletionRequest:
    row = DeletionRequest(tenant_id=tenant_id, scope=DeletionScope(scope).value, ids=sorted(set(ids)),
                          reason=reason, requested_by=actor, created_at=utcnow(), result={})
    session.add(row)
    session.flush()
    audit.record(session, actor=actor, action="deletion.request", target=f"deletion:{row.id}",
                 tenant_id=tenant_id, after={"scope": row.scope, "ids": row.ids, "reason": reason})
    return row


def get_deletion(session: Session, request_id: int) -> DeletionRequest:
    row = session.get(DeletionRequest, request_id)
    if row is None:
        raise NotFound(f"deletion request {request_id} not found")
    return row


def list_deletions(session: Session, tenant_ids: list[str] | None = None, limit: int = 100,
                   offset: int = 0, states: list[str] | None = None) -> list[DeletionRequest]:
    q = select(DeletionRequest).order_by(DeletionRequest.id)
    if states is not None:
        q = q.where(DeletionRequest.state.in_(states))
    if tenant_ids is not None:
        q = q.where(DeletionRequest.tenant_id.in_(tenant_ids))
    return list(session.scalars(q.offset(offset).limit(limit)))
