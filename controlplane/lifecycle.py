"""A version's lifecycle as persisted actions: each one checks the state machine, changes
the rows with a compare-and-set, and appends its audit entry in the same transaction.

Callers commit. Desired state (aliases, nodes' desired versions, promotion rows) is
written here; the rollout reconciler and the nodes converge on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from adaflash.contracts import ALIAS_CHAMPION, ALIAS_PREVIOUS
from adaflash.contracts.evaluation import EvaluationReport
from controlplane import audit
from controlplane.db import utcnow
from controlplane.errors import Conflict, NotFound
from controlplane.gates import GatePolicy, GateResult, VersionInfo, all_passed, evaluate_gates
from controlplane.models import Alias, Approval, Evaluation, GateResultRow, Node, Promotion, Tenant, Version
from controlplane.states import (
    ACTIVE_PROMOTION_STATES,
    PINNABLE_STATES,
    PRE_SERVING_STATES,
    PROMOTION_TRANSITIONS,
    VERSION_TRANSITIONS,
    PromotionKind,
    PromotionState,
    VersionState,
    can_transition,
)

SYSTEM_GATES = "system:gates"
SYSTEM_POLICY = "system:policy"
SYSTEM_REAPER = "system:reaper"


# -- reading ------------------------------------------------------------------------------------
def get_version(session: Session, version: str) -> Version:
    row = session.get(Version, version)
    if row is None:
        raise NotFound(f"version {version!r} not found")
    return row


def alias(session: Session, name: str) -> str | None:
    row = session.get(Alias, name)
    return row.version if row else None


def active_promotion(session: Session, version: str | None = None) -> Promotion | None:
    q = select(Promotion).where(Promotion.state.in_([s.value for s in ACTIVE_PROMOTION_STATES]))
    if version is not None:
        q = q.where(Promotion.version == version)
    return session.scalars(q.order_by(Promotion.id)).first()


def snapshot(v: Version) -> dict[str, Any]:
    return {"version": v.version, "state": v.state, "state_reason": v.state_reason,
            "manifest_sha256": v.manifest_sha256}


def promotion_snapshot(p: Promotion) -> dict[str, Any]:
    return {"id": p.id, "kind": p.kind, "version": p.version, "from_version": p.from_version,
            "state": p.state, "canary_nodes": list(p.canary_nodes or []), "reason": p.reason}


# -- transitions ----------------------------------------------------------------------------------
def transition(session: Session, v: Version, new: VersionState, *, actor: str, reason: str | None = None,
               now: datetime | None = None) -> Version:
    """Move ``v`` to ``new`` if the lifecycle allows it and nobody moved it meanwhile."""
    old = VersionState(v.state)
    if not can_transition(VERSION_TRANSITIONS, old, new):
        raise Conflict(f"version {v.version} is {old.value}; it cannot become {new.value}")
    before = snapshot(v)
    now = now or utcnow()
    res = session.execute(update(Version).where(Version.version == v.version, Version.state == old.value)
                          .values(state=new.value, state_reason=reason, state_changed_at=now)
                          .execution_options(synchronize_session="fetch"))
    if res.rowcount != 1:
        raise Conflict(f"version {v.version} changed state concurrently; retry")
    session.refresh(v)
    audit.record(session, actor=actor, action=f"version.{new.value}", target=f"version:{v.version}",
                 before=before, after=snapshot(v), at=now)
    return v


def advance_promotion(session: Session, p: Promotion, new: PromotionState, *, actor: str,
                      now: datetime | None = None, **fields: Any) -> Promotion:
    """Persist a rollout step before anyone acts on it (compare-and-set on the old state)."""
    old = PromotionState(p.state)
    if not can_transition(PROMOTION_TRANSITIONS, old, new):
        raise Conflict(f"promotion {p.id} is {old.value}; it cannot become {new.value}")
    before = promotion_snapshot(p)
    now = now or utcnow()
    res = session.execute(update(Promotion).where(Promotion.id == p.id, Promotion.state == old.value)
                          .values(state=new.value, updated_at=now, **fields)
                          .execution_options(synchronize_session="fetch"))
    if res.rowcount != 1:
        raise Conflict(f"promotion {p.id} changed state concurrently; retry")
    session.refresh(p)
    audit.record(session, actor=actor, action=f"promotion.{new.value}", target=f"promotion:{p.id}",
                 before=before, after=promotion_snapshot(p), at=now)
    return p


def _set_alias(session: Session, name: str, version: str | None, now: datetime) -> None:
    if version is None:
        session.execute(delete(Alias).where(Alias.name == name))
        return
    row = session.get(Alias, name)
    if row is None:
        session.add(Alias(name=name, version=version, updated_at=now))
    else:
        row.version, row.updated_at = version, now


# -- registration and evaluation ----------------------------------------------------------------------
def register_version(session: Session, *, version: str, target_id: str, source_uri: str,
                     run_id: str | None, manifest_sha256: str | None, lineage: Mapping[str, Any],
                     created_at: datetime, candidate_ttl_hours: float, actor: str,
                     state_reason: str | None = None) -> Version:
    if session.get(Version, version) is not None:
        raise Conflict(f"version {version!r} is already recorded")
    row = Version(version=version, target_id=target_id, source_uri=source_uri, mlflow_run_id=run_id,
                  manifest_sha256=manifest_sha256, lineage=audit._jsonable(dict(lineage)),
                  state=VersionState.registered.value, state_reason=state_reason, created_at=created_at,
                  state_changed_at=utcnow(), expires_at=created_at + timedelta(hours=candidate_ttl_hours))
    session.add(row)
    session.flush()
    audit.record(session, actor=actor, action="version.register", target=f"version:{version}",
                 after={**snapshot(row), "source_uri": source_uri, "run_id": run_id})
    return row


def start_evaluation(session: Session, version: str, *, actor: str) -> Evaluation:
    v = get_version(session, version)
    transition(session, v, VersionState.evaluating, actor=actor)
    ev = Evaluation(version=version, champion_version=alias(session, ALIAS_CHAMPION), status="running",
                    created_at=utcnow())
    session.add(ev)
    session.flush()
    return ev


def complete_evaluation(session: Session, evaluation_id: int, report: Mapping[str, Any] | EvaluationReport,
                        plots: Mapping[str, str], *, actor: str) -> Evaluation:
    """Store a finished report (validated against the contract) and its plot files."""
    ev = session.get(Evaluation, evaluation_id)
    if ev is None:
        raise NotFound(f"evaluation {evaluation_id} not found")
    parsed = report if isinstance(report, EvaluationReport) else EvaluationReport.model_validate(report)
    ev.report = parsed.model_dump(mode="json")
    ev.plots, ev.status, ev.completed_at = dict(plots), "completed", utcnow()
    v = session.get(Version, ev.version)
    if v is not None:  # what the version is expected to do live (compared with what it does: fleet.py)
        v.predicted_tau = parsed.candidate.tau
        v.predicted_tps = next((p.tokens_per_s for p in parsed.candidate.throughput if p.concurrency == 1), None)
    audit.record(session, actor=actor, action="evaluation.complete", target=f"evaluation:{ev.id}",
                 after={"version": ev.version, "n_records": parsed.n_records, "plots": sorted(plots)})
    return ev


def apply_gates(session: Session, version: str, evaluation_id: int | None, policy: GatePolicy, *,
                now: datetime, default_ttl_days: float, actor: str = SYSTEM_GATES) -> list[GateResult]:
    """Judge an evaluated version: store each gate result, then gate_failed or awaiting_approval
    (and approved at once when the policy approves automatically)."""
    v = get_version(session, version)
    ev = session.get(Evaluation, evaluation_id) if evaluation_id is not None else None
    ttls = {t.tenant_id: t.ttl_days for t in session.scalars(select(Tenant))}
    champ = session.get(Version, ev.champion_version) if ev is not None and ev.champion_version else None
    ratio = (champ.realised_tau / champ.predicted_tau
             if champ is not None and champ.realised_tau is not None and champ.predicted_tau else None)
    info = VersionInfo(version=v.version, created_at=v.created_at, lineage=v.lineage or {},
                       tenant_ttl_days=ttls, default_ttl_days=default_ttl_days, champion_realised_ratio=ratio)
    results = evaluate_gates((ev.report if ev else None) or {}, info, policy, now)
    for r in results:
        session.add(GateResultRow(version=version, evaluation_id=evaluation_id, policy_version=policy.policy_version,
                                  name=r.name, passed=r.passed, value=_finite(r.value),
                                  threshold=_finite(r.threshold), reason=r.reason, created_at=now))
    if not all_passed(results):
        failed = ", ".join(r.name for r in results if not r.passed)
        transition(session, v, VersionState.gate_failed, actor=actor, reason=f"failed gates: {failed}", now=now)
        return results
    transition(session, v, VersionState.awaiting_approval, actor=actor,
               reason=f"passed every gate of policy {policy.policy_version}", now=now)
    if policy.approval == "auto":
        approve(session, version, actor=SYSTEM_POLICY, reason=f"policy {policy.policy_version}: approval auto",
                policy_version=policy.policy_version, now=now)
    return results


def _finite(x: float | None) -> float | None:
    return None if x is None or x != x or x in (float("inf"), float("-inf")) else x


# -- decisions --------------------------------------------------------------------------------------------
def approve(session: Session, version: str, *, actor: str, reason: str = "", policy_version: str | None = None,
            now: datetime | None = None) -> Promotion:
    """awaiting_approval -> approved, and a pending promotion for the reconciler to carry out."""
    now = now or utcnow()
    v = get_version(session, version)
    transition(session, v, VersionState.approved, actor=actor, reason=reason or None, now=now)
    session.add(Approval(version=version, decision="approved", actor=actor, reason=reason,
                         policy_version=policy_version, created_at=now))
    promo = Promotion(kind=PromotionKind.promote.value, version=version,
                      from_version=alias(session, ALIAS_CHAMPION), state=PromotionState.pending.value,
                      canary_nodes=[], requested_by=actor, reason=reason or None, created_at=now,
                      updated_at=now)
    session.add(promo)
    session.flush()
    audit.record(session, actor=actor, action="promotion.create", target=f"promotion:{promo.id}",
                 after=promotion_snapshot(promo), at=now)
    return promo


def reject(session: Session, version: str, *, actor: str, reason: str, now: datetime | None = None) -> Version:
    now = now or utcnow()
    v = get_version(session, version)
    transition(session, v, VersionState.rejected, actor=actor, reason=reason, now=now)
    session.add(Approval(version=version, decision="rejected", actor=actor, reason=reason, created_at=now))
    _abort_pending(session, version, actor=actor, now=now)
    return v


def _abort_pending(session: Session, version: str, *, actor: str, now: datetime) -> None:
    p = active_promotion(session, version)
    if p is not None and p.state == PromotionState.pending.value:
        advance_promotion(session, p, PromotionState.aborted, actor=actor, now=now)


def expire_candidates(session: Session, now: datetime | None = None) -> list[str]:
    """The TTL reaper: candidates not yet serving whose expires_at has passed become expired."""
    now = now or utcnow()
    due = session.scalars(select(Version).where(Version.state.in_([s.value for s in PRE_SERVING_STATES]),
                                                Version.expires_at < now)).all()
    for v in due:
        transition(session, v, VersionState.expired, actor=SYSTEM_REAPER,
                   reason=f"candidate TTL passed at {v.expires_at.isoformat()}", now=now)
        _abort_pending(session, v.version, actor=SYSTEM_REAPER, now=now)
    return [v.version for v in due]


def rollback(session: Session, version: str, *, actor: str, reason: str, now: datetime | None = None) -> Promotion:
    """Take ``version`` out of service in one call.

    A champion gives way to the ``previous`` alias; a canary (a promotion in flight) gives
    way to the champion it was replacing. Nodes' desired versions change at once; the
    reconciler finishes the promotion row when heartbeats show the nodes converged.
    """
    now = now or utcnow()
    v = get_version(session, version)
    if v.state == VersionState.canary.value:
        p = active_promotion(session, version)
        if p is None:
            raise Conflict(f"version {version} is canary but no promotion of it is active")
        advance_promotion(session, p, PromotionState.rolling_back, actor=actor, now=now, reason=reason)
        transition(session, v, VersionState.rolled_back, actor=actor, reason=reason, now=now)
        _retarget_nodes(session, version, p.from_version, actor=actor, now=now)
        return p
    if v.state != VersionState.champion.value:
        raise Conflict(f"version {version} is {v.state}; only a champion or a canary can be rolled back")
    in_flight = active_promotion(session)
    if in_flight is not None:
        raise Conflict(f"promotion {in_flight.id} of version {in_flight.version} is {in_flight.state}; "
                       "roll that back or let it finish first")
    previous = alias(session, ALIAS_PREVIOUS)
    if previous is None:
        raise Conflict(f"there is no previous version to roll {version} back to")
    p = Promotion(kind=PromotionKind.rollback.value, version=previous, from_version=version,
                  state=PromotionState.pending.value, canary_nodes=[], reason=reason, requested_by=actor,
                  created_at=now, updated_at=now)
    session.add(p)
    session.flush()
    audit.record(session, actor=actor, action="promotion.create", target=f"promotion:{p.id}",
                 after=promotion_snapshot(p), at=now)
    advance_promotion(session, p, PromotionState.rolling_back, actor=actor, now=now)
    transition(session, v, VersionState.rolled_back, actor=actor, reason=reason, now=now)
    transition(session, get_version(session, previous), VersionState.champion, actor=actor,
               reason=f"reinstated by rollback of {version}", now=now)
    _set_alias(session, ALIAS_CHAMPION, previous, now)
    _set_alias(session, ALIAS_PREVIOUS, None, now)
    audit.record(session, actor=actor, action="alias.set", target="alias:champion",
                 before={"champion": version, "previous": previous}, after={"champion": previous, "previous": None},
                 at=now)
    _retarget_nodes(session, version, previous, actor=actor, now=now)
    return p


def _retarget_nodes(session: Session, old: str, new: str | None, *, actor: str, now: datetime) -> None:
    nodes = session.scalars(select(Node).where(Node.desired_version == old)).all()
    for n in nodes:
        n.desired_version = new
    if nodes:
        audit.record(session, actor=actor, action="nodes.desired", target=f"version:{old}",
                     before={"desired_version": old, "nodes": sorted(n.node_id for n in nodes)},
                     after={"desired_version": new}, at=now)


# -- pins ------------------------------------------------------------------------------------------------
def pin(session: Session, version: str, node_ids: list[str] | None, *, actor: str, reason: str) -> list[str]:
    """Hold nodes (all when ``node_ids`` is empty) on ``version`` whatever rollouts decide."""
    v = get_version(session, version)
    if VersionState(v.state) not in PINNABLE_STATES:
        raise Conflict(f"version {version} is {v.state}; only {', '.join(sorted(PINNABLE_STATES))} "
                       "versions can be pinned")
    nodes = _nodes(session, node_ids)
    before = {n.node_id: n.pinned_version for n in nodes}
    for n in nodes:
        n.pinned_version = version
    audit.record(session, actor=actor, action="version.pin", target=f"version:{version}",
                 before={"pinned": before}, after={"pinned": {n.node_id: version for n in nodes}, "reason": reason})
    return [n.node_id for n in nodes]


def unpin(session: Session, version: str, node_ids: list[str] | None, *, actor: str, reason: str) -> list[str]:
    get_version(session, version)
    nodes = [n for n in _nodes(session, node_ids) if n.pinned_version == version]
    for n in nodes:
        n.pinned_version = None
    audit.record(session, actor=actor, action="version.unpin", target=f"version:{version}",
                 before={"pinned": {n.node_id: version for n in nodes}},
                 after={"pinned": {n.node_id: None for n in nodes}, "reason": reason})
    return [n.node_id for n in nodes]


def _nodes(session: Session, node_ids: list[str] | None) -> list[Node]:
    if not node_ids:
        return list(session.scalars(select(Node).order_by(Node.node_id)))
    found = {n.node_id: n for n in session.scalars(select(Node).where(Node.node_id.in_(node_ids)))}
    missing = sorted(set(node_ids) - set(found))
    if missing:
        raise NotFound(f"unknown nodes: {', '.join(missing)}")
    return [found[i] for i in sorted(found)]


# -- rollout steps (the reconciler drives these; each is persisted before nodes act) ---------------------------
def _set_desired(session: Session, node_ids: list[str], version: str | None, *, actor: str, now: datetime) -> None:
    nodes = _nodes(session, node_ids) if node_ids else []
    before = {n.node_id: n.desired_version for n in nodes}
    for n in nodes:
        n.desired_version = version
    audit.record(session, actor=actor, action="nodes.desired", target=f"version:{version}",
                 before={"desired": before}, after={"desired": {n.node_id: version for n in nodes}}, at=now)


def begin_canary(session: Session, p: Promotion, canary_nodes: list[str], *, actor: str,
                 now: datetime | None = None) -> Promotion:
    """pending -> canary: the chosen canary nodes get the candidate as their desired version."""
    now = now or utcnow()
    advance_promotion(session, p, PromotionState.canary, actor=actor, now=now, canary_nodes=sorted(canary_nodes))
    transition(session, get_version(session, p.version), VersionState.canary, actor=actor, now=now)
    _set_desired(session, sorted(canary_nodes), p.version, actor=actor, now=now)
    return p


def begin_watch(session: Session, p: Promotion, watch_s: float, *, actor: str, now: datetime | None = None):
    """canary -> watching: the canaries serve the candidate; live metrics are judged until watch_until."""
    now = now or utcnow()
    return advance_promotion(session, p, PromotionState.watching, actor=actor, now=now,
                             watch_until=now + timedelta(seconds=watch_s))


def begin_rollout(session: Session, p: Promotion, *, actor: str, now: datetime | None = None) -> Promotion:
    """pending | watching -> rolling_out: every node gets the candidate as its desired version
    (straight from pending when the fleet has no canary node)."""
    now = now or utcnow()
    was_pending = p.state == PromotionState.pending.value
    advance_promotion(session, p, PromotionState.rolling_out, actor=actor, now=now)
    if was_pending:
        transition(session, get_version(session, p.version), VersionState.canary, actor=actor, now=now)
    _set_desired(session, [n.node_id for n in _nodes(session, None)], p.version, actor=actor, now=now)
    return p


def complete_promotion(session: Session, p: Promotion, *, actor: str, now: datetime | None = None) -> Promotion:
    """rolling_out -> completed (the candidate is champion, the old champion `previous`), or
    rolling_back -> completed for an operator rollback whose nodes converged."""
    now = now or utcnow()
    if p.kind == PromotionKind.rollback.value:
        return advance_promotion(session, p, PromotionState.completed, actor=actor, now=now)
    old = alias(session, ALIAS_CHAMPION)
    advance_promotion(session, p, PromotionState.completed, actor=actor, now=now)
    if old is not None and old != p.version:
        transition(session, get_version(session, old), VersionState.retired, actor=actor,
                   reason=f"replaced by {p.version}", now=now)
    transition(session, get_version(session, p.version), VersionState.champion, actor=actor, now=now)
    _set_alias(session, ALIAS_PREVIOUS, old if old != p.version else alias(session, ALIAS_PREVIOUS), now)
    _set_alias(session, ALIAS_CHAMPION, p.version, now)
    audit.record(session, actor=actor, action="alias.set", target="alias:champion",
                 before={"champion": old}, after={"champion": p.version, "previous": old}, at=now)
    return p
