"""Serving nodes as the control plane sees them: heartbeats in, desired versions out.

Level-triggered: a node polls its desired version and reports what it serves; a
restarted node or control plane converges without replaying events.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash.contracts import ALIAS_CHAMPION
from controlplane import audit, canary_judge
from controlplane.db import utcnow
from controlplane.errors import NotFound
from controlplane.lifecycle import alias
from controlplane.models import Node, Version
from controlplane.states import NodeRole


@dataclass(frozen=True)
class Heartbeat:
    served_version: str | None
    url: str
    live_tau: float | None = None
    live_tps: float | None = None
    error_rate: float | None = None
    live_load: float | None = None  # requests in flight (running + waiting)
    status: str = "ready"
    message: str | None = None


@dataclass(frozen=True)
class Desired:
    version: str
    uri: str
    sha256: str | None


def get_node(session: Session, node_id: str) -> Node:
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id!r} not found")
    return node


def list_nodes(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).order_by(Node.node_id)))


def is_stale(node: Node, now: datetime, timeout_s: float) -> bool:
    return node.last_heartbeat_at is None or (now - node.last_heartbeat_at).total_seconds() > timeout_s


def heartbeat(session: Session, node_id: str, hb: Heartbeat, *, actor: str, now: datetime | None = None) -> Node:
    """Record a node's report. The first one registers the node (regular role, desired =
    champion). Routine heartbeats are not audited; registration and a change of the
    served version are."""
    now = now or utcnow()
    node = session.get(Node, node_id)
    if node is None:
        node = Node(node_id=node_id, url=hb.url, role=NodeRole.regular.value,
                    desired_version=alias(session, ALIAS_CHAMPION), created_at=now)
        session.add(node)
        audit.record(session, actor=actor, action="node.register", target=f"node:{node_id}",
                     after={"url": hb.url, "served_version": hb.served_version,
                            "desired_version": node.desired_version}, at=now)
    elif node.served_version != hb.served_version:
        audit.record(session, actor=actor, action="node.served_version", target=f"node:{node_id}",
                     before={"served_version": node.served_version},
                     after={"served_version": hb.served_version, "desired_version": node.desired_version,
                            "status": hb.status, "message": hb.message}, at=now)
    node.url, node.served_version, node.last_heartbeat_at = hb.url, hb.served_version, now
    node.live_tau, node.live_tps, node.error_rate = hb.live_tau, hb.live_tps, hb.error_rate
    node.live_load = hb.live_load
    canary_judge.update_profile(node)
    node.status, node.status_message = hb.status, hb.message
    node.heartbeats = (node.heartbeats or 0) + 1
    session.flush()
    return node


def observe_served(session: Session, node_id: str, version: str, *, actor: str, how: str,
                   now: datetime | None = None) -> Node | None:
    """Record what a node answered directly (a push's reply) before its next heartbeat says so."""
    node = session.get(Node, node_id)
    if node is None or node.served_version == version:
        return node
    audit.record(session, actor=actor, action="node.served_version", target=f"node:{node_id}",
                 before={"served_version": node.served_version},
                 after={"served_version": version, "desired_version": node.desired_version, "observed": how},
                 at=now or utcnow())
    node.served_version = version
    return node


def desired(session: Session, node_id: str) -> Desired | None:
    """What the node should serve: its pin if any, else its desired version (None: keep
    serving what it has)."""
    node = session.get(Node, node_id)
    if node is None:
        return None
    version = node.pinned_version or node.desired_version
    if version is None:
        return None
    v = session.get(Version, version)
    return Desired(version=v.version, uri=v.source_uri, sha256=v.manifest_sha256)


def set_role(session: Session, node_id: str, role: NodeRole, *, actor: str) -> Node:
    node = get_node(session, node_id)
    before = {"role": node.role}
    node.role = NodeRole(role).value
    audit.record(session, actor=actor, action="node.role", target=f"node:{node_id}", before=before,
                 after={"role": node.role})
    return node
