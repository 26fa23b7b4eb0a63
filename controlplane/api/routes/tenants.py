"""Tenant policies and deletion requests (auditors see only their tenants)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy.orm import Session

from adaflash.config import Settings
from adaflash.contracts.tenancy import TenantPolicy
from controlplane import tenants
from controlplane.api.deps import ADMIN, READ, SessionDep, allow, get_settings
from controlplane.api.schemas import ID_PATTERN, DeletionIn, DeletionOut, Limit, Offset, TenantPolicyIn
from controlplane.auth import Principal, require_tenant, visible_tenants
from controlplane.models import DeletionRequest
from controlplane.states import Role

router = APIRouter(prefix="/tenants", tags=["tenants"])
deletions = APIRouter(prefix="/deletion-requests", tags=["tenants"])
TenantPath = Annotated[str, Path(pattern=ID_PATTERN)]


@router.get("", response_model=list[TenantPolicy], summary="Stored tenant policies")
def list_tenants(session: Session = SessionDep, who: Principal = Depends(allow(Role.auditor, *READ))):
    return tenants.list_policies(session, who.tenant_scope())


@router.get("/{tenant_id}/policy", response_model=TenantPolicy,
            summary="A tenant's policy (the configured defaults if none is stored)")
def get_policy(tenant_id: TenantPath, session: Session = SessionDep, settings: Settings = Depends(get_settings),
               who: Principal = Depends(allow(Role.node, Role.auditor, *READ))):
    require_tenant(who, tenant_id)
    return tenants.get_policy(session, tenant_id, settings.governance)


@router.put("/{tenant_id}/policy", response_model=TenantPolicy, summary="Store a tenant's policy")
def put_policy(tenant_id: TenantPath, body: TenantPolicyIn, session: Session = SessionDep,
               who: Principal = Depends(allow(*ADMIN))):
    policy = tenants.put_policy(session, TenantPolicy(tenant_id=tenant_id, **body.model_dump()), actor=who.actor)
    session.commit()
    return policy


def deletion_out(r: DeletionRequest) -> DeletionOut:
    return DeletionOut(id=r.id, tenant_id=r.tenant_id, scope=r.scope, ids=list(r.ids or []), reason=r.reason,
                       state=r.state, requested_by=r.requested_by, result=r.result or {}, created_at=r.created_at,
                       completed_at=r.completed_at)


@deletions.post("", response_model=DeletionOut, status_code=201,
                summary="Ask for a tenant's data (or some of its requests / records) to be purged everywhere")
def create_deletion(body: DeletionIn, session: Session = SessionDep, who: Principal = Depends(allow(*ADMIN))):
    row = tenants.create_deletion(session, tenant_id=body.tenant_id, scope=body.scope, ids=body.ids,
                                  reason=body.reason, actor=who.actor)
    session.commit()
    return deletion_out(row)


@deletions.get("", response_model=list[DeletionOut], summary="Deletion requests, oldest first")
def list_deletions(tenant_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
                   limit: Limit = 100, offset: Offset = 0,
                   session: Session = SessionDep, who: Principal = Depends(allow(Role.auditor, *READ))):
    rows = tenants.list_deletions(session, visible_tenants(who, tenant_id), limit=limit, offset=offset)
    return [deletion_out(r) for r in rows]


@deletions.get("/{request_id}", response_model=DeletionOut, summary="One deletion request")
def get_deletion(request_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: Session = SessionDep,
                 who: Principal = Depends(allow(Role.auditor, *READ))):
    row = tenants.get_deletion(session, request_id)
    require_tenant(who, row.tenant_id)
    return deletion_out(row)
