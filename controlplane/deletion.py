"""Deletion requests that execute: level-triggered, acknowledged per component, audited.

A request (scope ``tenant``) is pending work for every component that owns a store:

- the control plane purges its own stores at once, when the request is made (and the
  workers' pass retries any request it has not acknowledged yet, e.g. after a crash):
  the tenant's slice of every stored evaluation report (database row and report.json;
  the plots are drawn again from the redacted report) and the tenant's records in the
  JSONL evaluation window (controlplane.feedback_jsonl), rewritten without them. The
  Kafka window is not stored; shadow evaluation refuses the tenant's records created
  up to the request (``deleted_before``) while Kafka still holds them, and forgets its
  in-memory replay cache. Aggregates of a report (overall tau, calibration, counts)
  keep the tenant's contribution: they hold no record id and no text.
- every node (the nodes table) purges its emitter and producer queues, spool and
  usage-audit samples, then acknowledges (``POST /deletion-requests/{id}/ack``);
- every learner named in controlplane.deletion_learners purges its replay buffer,
  deferred records and the record ids of its checkpoint ledger, then acknowledges.

Components find their work with ``GET /deletion-requests?state=open&component=..&
instance=..`` (open requests they have not acknowledged): a restarted node, learner or
control plane converges without replaying events. The request is ``running`` once
the control plane purged its stores and ``completed`` when every required component
acknowledged. What only time purges is reported with the time it will be gone: the
records already in the Kafka topics stay until topic retention has passed
(``governance.retention``), counted from the last acknowledgement (after it no
component writes the tenant's older records). Candidate versions trained on the
tenant's data (``lineage.tenants``, and their descendants through
``lineage.parent_version``, whose weights started from them) are listed as
``trained_in_candidates`` for an operator to retire; nothing is silently kept.

Every step appends to the audit log: ``deletion.request``, ``deletion.purge`` (the
control plane), ``deletion.ack`` (each node and learner), ``deletion.complete``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from controlplane import audit, tenants
from controlplane.db import session_scope, utcnow
from controlplane.errors import Conflict, Invalid
from controlplane.models import DeletionAck, DeletionRequest, Evaluation, Node, Version
from controlplane.states import DeletionComponent, DeletionScope, DeletionState
from governance.retention import kafka_gone_by, topic_retention_ms

log = logging.getLogger("adaflash.controlplane.deletion")

SYSTEM_DELETION = "system:deletion"
CONTROLPLANE = DeletionComponent.controlplane.value
OPEN_STATES = (DeletionState.pending.value, DeletionState.running.value)


# -- the control plane's own stores ----------------------------------------------------------------
def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _redact_reports(session: Session, settings: Settings, tenant_id: str) -> int:
    """Remove the tenant's slice from every stored report (row, report.json, plots)."""
    from adaflash.contracts.evaluation import EvaluationReport
    from controlplane.shadow.store import evaluations_dir

    root = evaluations_dir(settings)
    n = 0
    for ev in session.scalars(select(Evaluation).where(Evaluation.report.is_not(None)).order_by(Evaluation.id)):
        report = dict(ev.report or {})
        per_tenant = dict(report.get("per_tenant") or {})
        if tenant_id not in per_tenant:
            continue
        del per_tenant[tenant_id]
        report["per_tenant"] = per_tenant
        ev.report = report  # a new object: the JSON column sees the change
        d = root / str(ev.id)
        if (d / "report.json").is_file():
            _atomic_write(d / "report.json", json.dumps(report, indent=1).encode())
        if ev.plots and d.is_dir():
            from controlplane.shadow import write_plots

            write_plots(EvaluationReport.model_validate(report), d)  # same names: the links stay
        n += 1
    return n


def _purge_jsonl_window(settings: Settings, tenant_id: str) -> int:
    """Rewrite the JSONL evaluation window without the tenant's records."""
    cp = settings.controlplane
    if not cp.feedback_jsonl:
        return 0
    path = Path(cp.feedback_jsonl)
    if not path.is_file():
        return 0
    keep, n = [], 0
    with path.open("rb") as f:
        for line in f:
            try:
                mine = json.loads(line).get("tenant_id") == tenant_id
            except (ValueError, AttributeError):
                mine = False  # not a record: kept as it was (the window skips it)
            if mine:
                n += 1
            else:
                keep.append(line)
    if n:
        _atomic_write(path, b"".join(keep))
    return n


def purge_controlplane(session: Session, settings: Settings, req: DeletionRequest) -> dict[str, int]:
    """Purge the control plane's stores of the request's tenant; returns store -> count."""
    from controlplane import eval_window

    return {"evaluation_reports": _redact_reports(session, settings, req.tenant_id),
            "evaluation_window": _purge_jsonl_window(settings, req.tenant_id),
            "evaluation_window_copy": eval_window.purge_tenant(session, req.tenant_id)}


# -- requests, acknowledgements, completion ------------------------------------------------------------
def _acks(session: Session, request_id: int) -> list[DeletionAck]:
    return list(session.scalars(select(DeletionAck).where(DeletionAck.request_id == request_id)
                                .order_by(DeletionAck.id)))


def _has_ack(session: Session, request_id: int, component: str, instance: str) -> DeletionAck | None:
    return session.scalar(select(DeletionAck).where(DeletionAck.request_id == request_id,
                                                    DeletionAck.component == component,
                                                    DeletionAck.instance == instance))


def required(session: Session, settings: Settings) -> list[tuple[str, str]]:
    """(component, instance) pairs a request waits for: the control plane, every known node,
    every configured learner."""
    nodes = session.scalars(select(Node.node_id).order_by(Node.node_id)).all()
    return ([(CONTROLPLANE, CONTROLPLANE)] + [(DeletionComponent.node.value, n) for n in nodes]
            + [(DeletionComponent.learner.value, lid) for lid in settings.controlplane.deletion_learners])


def execute(session: Session, settings: Settings, req: DeletionRequest, *, actor: str) -> DeletionAck:
    """The control plane's part: purge its stores, acknowledge, audit (idempotent)."""
    done = _has_ack(session, req.id, CONTROLPLANE, CONTROLPLANE)
    if done is not None:
        return done
    purged = purge_controlplane(session, settings, req)
    ack = DeletionAck(request_id=req.id, component=CONTROLPLANE, instance=CONTROLPLANE, purged=purged,
                      detail={}, actor=actor, acked_at=utcnow())
    session.add(ack)
    if req.state == DeletionState.pending.value:
        req.state = DeletionState.running.value
    audit.record(session, actor=actor, action="deletion.purge", target=f"deletion:{req.id}",
                 tenant_id=req.tenant_id, after={"component": CONTROLPLANE, "purged": purged})
    session.flush()
    maybe_complete(session, settings, req)
    return ack


def acknowledge(session: Session, settings: Settings, req: DeletionRequest, *, component: str, instance: str,
                purged: dict[str, int], detail: dict[str, Any], actor: str) -> DeletionAck:
    """A node's or learner's acknowledgement (repeating one is a no-op)."""
    component = DeletionComponent(component).value
    if component == CONTROLPLANE:
        raise Invalid("the control plane acknowledges its own purge")
    if req.scope != DeletionScope.tenant.value:
        raise Conflict(f"deletion request {req.id} has scope {req.scope!r}; only scope 'tenant' is executed")
    have = _has_ack(session, req.id, component, instance)
    if have is not None:
        return have
    ack = DeletionAck(request_id=req.id, component=component, instance=instance, purged=dict(purged),
                      detail=dict(detail), actor=actor, acked_at=utcnow())
    session.add(ack)
    audit.record(session, actor=actor, action="deletion.ack", target=f"deletion:{req.id}", tenant_id=req.tenant_id,
                 after={"component": component, "instance": instance, "purged": dict(purged),
                        "detail": dict(detail)})
    session.flush()
    maybe_complete(session, settings, req)
    return ack


def maybe_complete(session: Session, settings: Settings, req: DeletionRequest) -> bool:
    """Complete the request once every required component acknowledged."""
    if req.state == DeletionState.completed.value:
        return True
    view = describe(session, settings, req)
    if view["waiting_for"]:
        return False
    req.state, req.completed_at = DeletionState.completed.value, utcnow()
    req.result = {k: view[k] for k in ("purged", "pending", "complete_by", "trained_in_candidates")}
    audit.record(session, actor=SYSTEM_DELETION, action="deletion.complete", target=f"deletion:{req.id}",
                 tenant_id=req.tenant_id, after=req.result)
    return True


def create(session: Session, settings: Settings, *, tenant_id: str, scope: str, ids: list[str], reason: str,
           actor: str) -> DeletionRequest:
    """Store the request (committed: it is durable work), then the control plane's part at once."""
    row = tenants.create_deletion(session, tenant_id=tenant_id, scope=scope, ids=ids, reason=reason, actor=actor)
    session.commit()
    if row.scope == DeletionScope.tenant.value:
        try:
            execute(session, settings, row, actor=actor)
            session.commit()
        except Exception as e:  # the workers' pass retries: the request stays pending
            session.rollback()
            log.error("deletion %s: control-plane purge failed (%s); retried by the workers", row.id,
                      type(e).__name__)
    return row


def reconcile(sessions: sessionmaker[Session], settings: Settings) -> list[int]:
    """One pass of the workers: execute what the control plane has not, complete what is done."""
    touched = []
    with sessions() as s:
        ids = s.scalars(select(DeletionRequest.id).where(DeletionRequest.state.in_(OPEN_STATES),
                                                         DeletionRequest.scope == DeletionScope.tenant.value)
                        .order_by(DeletionRequest.id)).all()
    for rid in ids:
        with session_scope(sessions) as s:
            req = s.get(DeletionRequest, rid)
            if _has_ack(s, rid, CONTROLPLANE, CONTROLPLANE) is None:
                execute(s, settings, req, actor=SYSTEM_DELETION)
                touched.append(rid)
            elif maybe_complete(s, settings, req):
                touched.append(rid)
    return touched


def open_for(session: Session, component: str, instance: str, tenant_ids: list[str] | None = None,
             limit: int = 100) -> list[DeletionRequest]:
    """Open tenant-scope requests ``component``/``instance`` has not acknowledged yet."""
    acked = select(DeletionAck.request_id).where(DeletionAck.component == component,
                                                 DeletionAck.instance == instance)
    q = select(DeletionRequest).where(DeletionRequest.state.in_(OPEN_STATES),
                                      DeletionRequest.scope == DeletionScope.tenant.value,
                                      DeletionRequest.id.not_in(acked))
    if tenant_ids is not None:
        q = q.where(DeletionRequest.tenant_id.in_(tenant_ids))
    return list(session.scalars(q.order_by(DeletionRequest.id).limit(limit)))


def deleted_before(session: Session) -> dict[str, datetime]:
    """Tenant -> the newest tenant-scope deletion request's time: records created up to it
    must not be used any more (shadow evaluation reads Kafka, which still holds them)."""
    out: dict[str, datetime] = {}
    for t, at in session.execute(select(DeletionRequest.tenant_id, DeletionRequest.created_at)
                                 .where(DeletionRequest.scope == DeletionScope.tenant.value)):
        out[t] = max(out.get(t, at), at)
    return out


# -- what a request looks like -------------------------------------------------------------------------
def trained_in_candidates(session: Session, tenant_id: str) -> list[dict[str, Any]]:
    """Versions trained on the tenant's records, directly (lineage.tenants) or through a
    parent whose weights they started from (lineage.parent_version)."""
    versions = session.scalars(select(Version)).all()
    children: dict[str, list[Version]] = {}
    for v in versions:
        parent = (v.lineage or {}).get("parent_version")
        if parent:
            children.setdefault(str(parent), []).append(v)
    out: dict[str, dict[str, Any]] = {}
    todo = [(v, None) for v in versions if tenant_id in ((v.lineage or {}).get("tenants") or [])]
    while todo:
        v, via = todo.pop()
        if v.version in out:
            continue
        out[v.version] = {"version": v.version, "state": v.state,
                          "trained_on": "directly" if via is None else f"parent {via}"}
        todo += [(c, v.version) for c in children.get(v.version, [])]
    return sorted(out.values(), key=lambda d: (len(d["version"]), d["version"]))


def kafka_pending(session: Session, settings: Settings, req: DeletionRequest,
                  last_write: datetime | None) -> list[dict[str, Any]]:
    """The topics that may still hold the tenant's records and when retention removes them."""
    retention = topic_retention_ms(tenants.list_policies(session), settings.governance.default_ttl_days)
    gone = kafka_gone_by(retention, settings.kafka.segment_ms, last_write=last_write)
    return [{"store": f"kafka:{t}", "reason": "records stay until topic retention passes",
             "gone_by": gone.isoformat(), "retention_ms": retention, "segment_ms": settings.kafka.segment_ms}
            for t in (settings.kafka.feedback_topic, settings.kafka.dlq_topic)]


def describe(session: Session, settings: Settings, req: DeletionRequest) -> dict[str, Any]:
    """Per-component status, what is waiting, Kafka's gone-by time, trained-in candidates."""
    acks = {(a.component, a.instance): a for a in _acks(session, req.id)}
    need = required(session, settings) if req.state != DeletionState.completed.value else []
    components = []
    for key in dict.fromkeys(need + list(acks)):
        a = acks.get(key)
        components.append({"component": key[0], "instance": key[1], "state": "acked" if a else "waiting",
                           "purged": dict(a.purged or {}) if a else {}, "detail": dict(a.detail or {}) if a else {},
                           "acked_at": a.acked_at.isoformat() if a else None})
    waiting = [f"{c}:{i}" for c, i in need if (c, i) not in acks]
    if req.scope != DeletionScope.tenant.value:
        return {"components": components, "waiting_for": waiting or ["scope not executed"], "purged": {},
                "pending": [], "complete_by": None, "trained_in_candidates": []}
    # Until everyone acknowledged, a component may still write the tenant's older records:
    # the gone-by time is provisional (counted from now).
    last = max((a.acked_at for a in acks.values()), default=req.created_at) if not waiting else utcnow()
    pending = kafka_pending(session, settings, req, last)
    return {"components": components, "waiting_for": waiting,
            "purged": {f"{c}:{i}": dict(a.purged or {}) for (c, i), a in acks.items()},
            "pending": pending, "complete_by": max(p["gone_by"] for p in pending),
            "provisional": bool(waiting), "trained_in_candidates": trained_in_candidates(session, req.tenant_id)}


def describe_many(session: Session, settings: Settings, rows: Iterable[DeletionRequest]) -> list[dict[str, Any]]:
    return [describe(session, settings, r) for r in rows]
