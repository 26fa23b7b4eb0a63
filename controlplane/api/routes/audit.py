"""The audit log: read it (auditors see their tenants' entries) and verify its chain."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from controlplane import audit
from controlplane.api.deps import READ, SessionDep, allow
from controlplane.api.schemas import ID_PATTERN, AuditEntryOut, AuditVerifyOut, Limit
from controlplane.auth import Principal, visible_tenants
from controlplane.states import Role

router = APIRouter(prefix="/audit", tags=["audit"])


@router.get("", response_model=list[AuditEntryOut], summary="Audit entries in order, after a sequence number")
def list_audit(after_seq: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0, limit: Limit = 100,
               action: Annotated[str | None, Query(max_length=64, pattern=r"^[a-z_.]+$")] = None,
               tenant_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
               session: Session = SessionDep, who: Principal = Depends(allow(Role.auditor, *READ))):
    entries = audit.list_entries(session, after_seq=after_seq, limit=limit, action=action,
                                 tenant_ids=visible_tenants(who, tenant_id))
    return [AuditEntryOut(seq=e.seq, at=e.at, actor=e.actor, action=e.action, target=e.target,
                          tenant_id=e.tenant_id, before=e.before, after=e.after, prev_hash=e.prev_hash,
                          hash=e.hash) for e in entries]


@router.get("/verify", response_model=AuditVerifyOut, summary="Recompute the hash chain over the whole log")
def verify(session: Session = SessionDep, _: Principal = Depends(allow(Role.auditor, *READ))):
    r = audit.verify(session)
    return AuditVerifyOut(ok=r.ok, entries=r.entries, first_bad_seq=r.first_bad_seq, reason=r.reason)
