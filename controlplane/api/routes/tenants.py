"""Tenant policies and deletion requests (auditors see only their tenants)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy.orm import Session

from adaflash.config import Settings
from adaflash.contracts.tenancy import TenantPolicy
from controlplane import deletion, tenants
from controlplane.api.deps import ADMIN, READ, SessionDep, allow, get_settings
from controlplane.api.schemas import (
    ID_PATTERN,
    NODE_PATTERN,
    DeletionAckIn,
    DeletionIn,
    DeletionOut,
    Limit,
    Offset,
    TenantPolicyIn,
)
from controlplane.auth import Principal, require_node, require_tenant, visible_tenants
from controlplane.errors import Forbidden, Invalid
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


def deletion_out(session: Session, settings: Settings, r: DeletionRequest) -> DeletionOut:
    view = deletion.describe(session, settings, r)
    return DeletionOut(id=r.id, tenant_id=r.tenant_id, scope=r.scope, ids=list(r.ids or []), reason=r.reason,
                       state=r.state, requested_by=r.requested_by, result=r.result or {}, created_at=r.created_at,
                       completed_at=r.completed_at, components=view["components"], waiting_for=view["waiting_for"],
                       pending=view["pending"], complete_by=view["complete_by"],
                       provisional=view.get("provisional", False),
                       trained_in_candidates=view["trained_in_candidates"])


RequestPath = Annotated[int, Path(ge=1, le=2**31 - 1)]


@deletions.post("", response_model=DeletionOut, status_code=201,
                summary="Ask for a tenant's data (or some of its requests / records) to be purged everywhere; "
                        "the control plane purges its own stores at once, nodes and learners acknowledge theirs")
def create_deletion(body: DeletionIn, session: Session = SessionDep, settings: Settings = Depends(get_settings),
                    who: Principal = Depends(allow(*ADMIN))):
    row = deletion.create(session, settings, tenant_id=body.tenant_id, scope=body.scope, ids=body.ids,
                          reason=body.reason, actor=who.actor)
    return deletion_out(session, settings, row)


@deletions.get("", response_model=list[DeletionOut],
               summary="Deletion requests, oldest first; nodes and learners see only the open ones awaiting them")
def list_deletions(tenant_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
                   state: Annotated[Literal["open", "pending", "running", "completed", "failed"] | None,
                                    Query(description="open: pending or running")] = None,
                   component: Annotated[Literal["node", "learner"] | None,
                                        Query(description="with instance: only requests it has not acknowledged")]
                   = None,
                   instance: Annotated[str | None, Query(pattern=NODE_PATTERN)] = None,
                   limit: Limit = 100, offset: Offset = 0, session: Session = SessionDep,
                   settings: Settings = Depends(get_settings),
                   who: Principal = Depends(allow(Role.auditor, Role.node, Role.learner, *READ))):
    scope = visible_tenants(who, tenant_id)
    if who.role in (Role.node, Role.learner):
        # A component's work list: open requests it has not acknowledged, nothing else.
        component = who.role.value
        instance = instance or who.node_id
        if instance is None:
            raise Invalid("a node or learner lists its work with ?instance=<node id or learner id>")
        require_node(who, instance)
        state = "open"
    if component is not None or instance is not None:
        if component is None or instance is None or state not in (None, "open"):
            raise Invalid("component and instance go together, with state=open (or no state)")
        rows = deletion.open_for(session, component, instance, scope, limit=limit)
    else:
        rows = tenants.list_deletions(session, scope, limit=limit, offset=offset,
                                      states=list(deletion.OPEN_STATES) if state == "open" else
                                      [state] if state else None)
    return [deletion_out(session, settings, r) for r in rows]


@deletions.get("/{request_id}", response_model=DeletionOut,
               summary="One deletion request: per-component status and when Kafka's copies are gone")
def get_deletion(request_id: RequestPath, session: Session = SessionDep, settings: Settings = Depends(get_settings),
                 who: Principal = Depends(allow(Role.auditor, *READ))):
    row = tenants.get_deletion(session, request_id)
    require_tenant(who, row.tenant_id)
    return deletion_out(session, settings, row)


@deletions.post("/{request_id}/ack", response_model=DeletionOut,
                summary="A node or learner reports it purged the request's tenant from its stores "
                        "(admin: on behalf of a node or learner that is gone)")
def ack_deletion(request_id: RequestPath, body: DeletionAckIn, session: Session = SessionDep,
                 settings: Settings = Depends(get_settings),
                 who: Principal = Depends(allow(Role.node, Role.learner, *ADMIN))):
    if who.role in (Role.node, Role.learner) and body.component != who.role.value:
        raise Forbidden(f"a {who.role.value} key acknowledges as component {who.role.value!r} only")
    if who.role in (Role.node, Role.learner):
        require_node(who, body.instance)
    row = tenants.get_deletion(session, request_id)
    deletion.acknowledge(session, settings, row, component=body.component, instance=body.instance,
                         purged=body.purged, detail=body.detail, actor=who.actor)
    session.commit()
    return deletion_out(session, settings, row)
