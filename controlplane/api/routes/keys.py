"""API keys: admins create them (role, tenant scope, node binding) and revoke them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane import auth
from controlplane.api.deps import ADMIN, SessionDep, allow, current_principal
from controlplane.api.schemas import KeyCreated, KeyIn, KeyOut, WhoAmI
from controlplane.auth import Principal
from controlplane.models import ApiKey

router = APIRouter(prefix="/keys", tags=["keys"])
me = APIRouter(tags=["keys"])


def key_out(k: ApiKey) -> KeyOut:
    return KeyOut(key_id=k.key_id, name=k.name, role=k.role, tenants=list(k.tenants or []), node_id=k.node_id,
                  created_by=k.created_by, created_at=k.created_at, expires_at=k.expires_at,
                  revoked_at=k.revoked_at)


@me.get("/whoami", response_model=WhoAmI, summary="The caller as the control plane sees it")
def whoami(who: Principal = Depends(current_principal)):
    return WhoAmI(actor=who.actor, role=who.role, tenants=list(who.tenants), node_id=who.node_id)


@router.get("", response_model=list[KeyOut], summary="Every key (never its secret)")
def list_keys(session: Session = SessionDep, _: Principal = Depends(allow(*ADMIN))):
    return [key_out(k) for k in session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id))]


@router.post("", response_model=KeyCreated, status_code=201, summary="Create a key; its secret is shown once")
def create_key(body: KeyIn, session: Session = SessionDep, who: Principal = Depends(allow(*ADMIN))):
    row, plaintext = auth.create_key(session, name=body.name, role=body.role, actor=who.actor,
                                     tenants=body.tenants, node_id=body.node_id, expires_at=body.expires_at)
    session.commit()
    return KeyCreated(**key_out(row).model_dump(), key=plaintext)


@router.delete("/{key_id}", response_model=KeyOut, summary="Revoke a key")
def revoke_key(key_id: Annotated[str, Path(pattern=r"^[0-9a-f]{1,32}$")], session: Session = SessionDep,
               who: Principal = Depends(allow(*ADMIN))):
    row = auth.revoke_key(session, key_id, actor=who.actor)
    session.commit()
    return key_out(row)
