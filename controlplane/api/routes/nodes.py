"""Serving nodes: list and roles for operators; heartbeat and desired version for nodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from sqlalchemy.orm import Session

from adaflash.config import Settings
from controlplane import fleet
from controlplane.api.deps import ADMIN, READ, SessionDep, allow, get_settings
from controlplane.api.schemas import NODE_PATTERN, DesiredOut, HeartbeatIn, HeartbeatOut, NodeOut, NodeUpdate
from controlplane.auth import Principal, require_node
from controlplane.db import utcnow
from controlplane.models import Node
from controlplane.states import Role

router = APIRouter(prefix="/nodes", tags=["nodes"])
NodePath = Annotated[str, Path(pattern=NODE_PATTERN)]


def node_out(n: Node, settings: Settings) -> NodeOut:
    return NodeOut(node_id=n.node_id, url=n.url, role=n.role, desired_version=n.desired_version,
                   pinned_version=n.pinned_version, served_version=n.served_version,
                   last_heartbeat_at=n.last_heartbeat_at, live_tau=n.live_tau, live_tps=n.live_tps,
                   error_rate=n.error_rate, status=n.status, status_message=n.status_message,
                   stale=fleet.is_stale(n, utcnow(), settings.controlplane.heartbeat_timeout_s))


def _desired(session: Session, node_id: str) -> DesiredOut | None:
    d = fleet.desired(session, node_id)
    return DesiredOut(version=d.version, uri=d.uri, sha256=d.sha256) if d else None


@router.get("", response_model=list[NodeOut], summary="Every known node and its last heartbeat")
def list_nodes(session: Session = SessionDep, settings: Settings = Depends(get_settings),
               _: Principal = Depends(allow(*READ))):
    return [node_out(n, settings) for n in fleet.list_nodes(session)]


@router.get("/{node_id}", response_model=NodeOut, summary="One node")
def get_node(node_id: NodePath, session: Session = SessionDep, settings: Settings = Depends(get_settings),
             _: Principal = Depends(allow(*READ))):
    return node_out(fleet.get_node(session, node_id), settings)


@router.put("/{node_id}", response_model=NodeOut, summary="Set a node's role (canary or regular)")
def update_node(node_id: NodePath, body: NodeUpdate, session: Session = SessionDep,
                settings: Settings = Depends(get_settings), who: Principal = Depends(allow(*ADMIN))):
    node = fleet.set_role(session, node_id, body.role, actor=who.actor)
    session.commit()
    return node_out(node, settings)


@router.post("/{node_id}/heartbeat", response_model=HeartbeatOut,
             summary="A node reports what it serves and how; the answer is what it should serve")
def heartbeat(node_id: NodePath, body: HeartbeatIn, session: Session = SessionDep,
              who: Principal = Depends(allow(Role.node, Role.admin))):
    require_node(who, node_id)
    fleet.heartbeat(session, node_id, fleet.Heartbeat(**body.model_dump()), actor=who.actor)
    session.commit()
    return HeartbeatOut(node_id=node_id, desired=_desired(session, node_id))


@router.get("/{node_id}/desired", response_model=DesiredOut | None,
            summary="The drafter version this node should serve (null: keep serving what it has)")
def desired(node_id: NodePath, session: Session = SessionDep,
            who: Principal = Depends(allow(Role.node, *READ))):
    require_node(who, node_id)
    return _desired(session, node_id)
