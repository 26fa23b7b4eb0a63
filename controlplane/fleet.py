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
from adaflash.contracts.cost_curve import CostCurve
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
    cost_curve: dict | None = None  # adaflash.contracts.cost_curve.CostCurve as JSON


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
    if hb.cost_curve is not None and _due(node.cost_curve_at, now, COST_CURVE_EVERY_S):
        node.cost_curve, node.cost_curve_at = hb.cost_curve, now
    record_realised(session, hb, now)
    canary_judge.update_profile(node)
    node.status, node.status_message = hb.status, hb.message
    node.heartbeats = (node.heartbeats or 0) + 1
    session.flush()
    return node


REALISED_MIN_WEIGHT = 0.05  # the realised figures: a mean over the first 20 reports, then this EMA weight
# Heartbeats come every few seconds from every node; the version's realised figures and a
# node's stored cost curve are written at most this often (fewer writes on hot rows).
REALISED_EVERY_S = 5.0
COST_CURVE_EVERY_S = 30.0


def _due(last: datetime | None, now: datetime, every_s: float) -> bool:
    return last is None or (now - last).total_seconds() >= every_s


def record_realised(session: Session, hb: Heartbeat, now: datetime) -> None:
    """Fold a heartbeat's live tau / tokens/s into the figures realised by the version it
    serves (only heartbeats of a node that served traffic: tau and TPS above zero; at most
    one every ``REALISED_EVERY_S``)."""
    if not hb.served_version or not hb.live_tau or not hb.live_tps:
        return
    v = session.get(Version, hb.served_version)
    if v is None or not _due(v.realised_at, now, REALISED_EVERY_S):
        return
    n = (v.realised_samples or 0) + 1
    w = max(REALISED_MIN_WEIGHT, 1.0 / n)

    def fold(old: float | None, new: float | None) -> float | None:
        if new is None:
            return old
        return new if old is None else (1.0 - w) * old + w * new

    v.realised_tau, v.realised_tps = fold(v.realised_tau, hb.live_tau), fold(v.realised_tps, hb.live_tps)
    v.realised_load = fold(v.realised_load, hb.live_load)
    v.realised_samples, v.realised_at = n, now


def latest_cost_curve(session: Session) -> tuple[str, CostCurve] | None:
    """The newest measured cost curve a node reported: (node id, curve), None when no node has one."""
    rows = session.scalars(select(Node).where(Node.cost_curve.is_not(None))
                           .order_by(Node.cost_curve_at.desc(), Node.node_id)).all()
    for node in rows:
        try:
            curve = CostCurve.model_validate(node.cost_curve)
        except ValueError:
            continue
        if curve.measured:
            return node.node_id, curve
    return None


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
