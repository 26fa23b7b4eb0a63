"""Drafter versions: their lifecycle, approvals, pins and rollback."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane import lifecycle
from controlplane.api.deps import ADMIN, APPROVE, READ, SessionDep, allow, get_policy
from controlplane.api.schemas import (
    VERSION_PATTERN,
    ApprovalOut,
    ApproveIn,
    GateResultOut,
    Limit,
    Offset,
    PinIn,
    PinOut,
    PredictedRealised,
    PromotionOut,
    ReasonIn,
    VersionDetail,
    VersionOut,
)
from controlplane.auth import Principal
from controlplane.gates import GatePolicy
from controlplane.models import Alias, Approval, Evaluation, GateResultRow, Promotion, Version
from controlplane.states import VersionState

router = APIRouter(prefix="/versions", tags=["versions"])
VersionPath = Annotated[str, Path(pattern=VERSION_PATTERN, description="registry version")]


def _aliases(session: Session) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in session.scalars(select(Alias)):
        out.setdefault(a.version, []).append(a.name)
    return out


def version_out(v: Version, aliases: dict[str, list[str]]) -> VersionOut:
    return VersionOut(version=v.version, target_id=v.target_id, state=v.state, state_reason=v.state_reason,
                      mlflow_run_id=v.mlflow_run_id, source_uri=v.source_uri, manifest_sha256=v.manifest_sha256,
                      lineage=v.lineage or {}, created_at=v.created_at, state_changed_at=v.state_changed_at,
                      expires_at=v.expires_at, aliases=sorted(aliases.get(v.version, [])))


def promotion_out(p: Promotion) -> PromotionOut:
    return PromotionOut(id=p.id, kind=p.kind, version=p.version, from_version=p.from_version, state=p.state,
                        canary_nodes=list(p.canary_nodes or []), watch_until=p.watch_until, reason=p.reason,
                        requested_by=p.requested_by, created_at=p.created_at, updated_at=p.updated_at)


def _detail(session: Session, version: str) -> VersionDetail:
    v = lifecycle.get_version(session, version)
    gates = session.scalars(select(GateResultRow).where(GateResultRow.version == version)
                            .order_by(GateResultRow.id)).all()
    approvals = session.scalars(select(Approval).where(Approval.version == version).order_by(Approval.id)).all()
    evals = session.scalars(select(Evaluation.id).where(Evaluation.version == version)
                            .order_by(Evaluation.id)).all()
    promos = session.scalars(select(Promotion).where(Promotion.version == version).order_by(Promotion.id)).all()
    return VersionDetail(
        **version_out(v, _aliases(session)).model_dump(),
        gate_results=[GateResultOut(name=g.name, passed=g.passed, value=g.value, threshold=g.threshold,
                                    reason=g.reason, policy_version=g.policy_version,
                                    evaluation_id=g.evaluation_id, created_at=g.created_at) for g in gates],
        approvals=[ApprovalOut(decision=a.decision, actor=a.actor, reason=a.reason, policy_version=a.policy_version,
                               created_at=a.created_at) for a in approvals],
        evaluation_ids=list(evals), promotions=[promotion_out(p) for p in promos], figures=figures(v))


def figures(v: Version) -> PredictedRealised:
    ratio = (v.realised_tau / v.predicted_tau) if v.realised_tau is not None and v.predicted_tau else None
    return PredictedRealised(predicted_tau=v.predicted_tau, predicted_tps=v.predicted_tps,
                             realised_tau=v.realised_tau, realised_tps=v.realised_tps, realised_load=v.realised_load,
                             realised_samples=v.realised_samples or 0, realised_at=v.realised_at, tau_ratio=ratio)


@router.get("", response_model=list[VersionOut], summary="List versions, newest first")
def list_versions(state: VersionState | None = None, limit: Limit = 100,
                  offset: Offset = 0, session: Session = SessionDep,
                  _: Principal = Depends(allow(*READ))):
    q = select(Version)
    if state is not None:
        q = q.where(Version.state == state.value)
    rows = session.scalars(q.order_by(Version.created_at.desc(), Version.version.desc())
                           .offset(offset).limit(limit)).all()
    aliases = _aliases(session)
    return [version_out(v, aliases) for v in rows]


@router.get("/{version}", response_model=VersionDetail, summary="One version with its gates and approvals")
def get_version(version: VersionPath, session: Session = SessionDep, _: Principal = Depends(allow(*READ))):
    return _detail(session, version)


@router.get("/{version}/plots/predicted_vs_realised", response_class=Response,
            summary="Shadow-predicted against realised live tau and tokens/s (PNG)",
            responses={200: {"content": {"image/png": {}}, "description": "the plot"}})
def predicted_vs_realised_plot(version: VersionPath, session: Session = SessionDep,
                               _: Principal = Depends(allow(*READ))):
    import tempfile
    from pathlib import Path as FsPath

    from controlplane.shadow.plots import plot_predicted_realised

    v = lifecycle.get_version(session, version)
    with tempfile.TemporaryDirectory(prefix="adaflash-plot-") as d:
        path = plot_predicted_realised([{"version": v.version, **figures(v).model_dump()}], FsPath(d) / "plot.png")
        return Response(content=path.read_bytes(), media_type="image/png")


@router.post("/{version}/approve", response_model=VersionDetail, summary="Approve a version awaiting approval")
def approve(version: VersionPath, body: ApproveIn, session: Session = SessionDep,
            policy: GatePolicy = Depends(get_policy), who: Principal = Depends(allow(*APPROVE))):
    lifecycle.approve(session, version, actor=who.actor, reason=body.reason, policy_version=policy.policy_version)
    session.commit()
    return _detail(session, version)


@router.post("/{version}/reject", response_model=VersionDetail, summary="Reject a candidate, with a reason")
def reject(version: VersionPath, body: ReasonIn, session: Session = SessionDep,
           who: Principal = Depends(allow(*APPROVE))):
    lifecycle.reject(session, version, actor=who.actor, reason=body.reason)
    session.commit()
    return _detail(session, version)


@router.post("/{version}/rollback", response_model=PromotionOut,
             summary="Take a champion (or canary) out of service; the previous version serves again")
def rollback(version: VersionPath, body: ReasonIn, session: Session = SessionDep,
             who: Principal = Depends(allow(*APPROVE))):
    promo = lifecycle.rollback(session, version, actor=who.actor, reason=body.reason)
    session.commit()
    return promotion_out(promo)


@router.post("/{version}/pin", response_model=PinOut, summary="Hold nodes (all if none listed) on this version")
def pin(version: VersionPath, body: PinIn, session: Session = SessionDep, who: Principal = Depends(allow(*ADMIN))):
    nodes = lifecycle.pin(session, version, body.node_ids, actor=who.actor, reason=body.reason)
    session.commit()
    return PinOut(version=version, nodes=nodes)


@router.post("/{version}/unpin", response_model=PinOut, summary="Release nodes pinned to this version")
def unpin(version: VersionPath, body: PinIn, session: Session = SessionDep,
          who: Principal = Depends(allow(*ADMIN))):
    nodes = lifecycle.unpin(session, version, body.node_ids, actor=who.actor, reason=body.reason)
    session.commit()
    return PinOut(version=version, nodes=nodes)


promotions = APIRouter(prefix="/promotions", tags=["versions"])


@promotions.get("", response_model=list[PromotionOut], summary="Rollouts and rollbacks, newest first")
def list_promotions(active: bool = False, limit: Limit = 100, offset: Offset = 0,
                    session: Session = SessionDep, _: Principal = Depends(allow(*READ))):
    q = select(Promotion)
    if active:
        q = q.where(Promotion.state.in_([s.value for s in lifecycle.ACTIVE_PROMOTION_STATES]))
    return [promotion_out(p) for p in session.scalars(q.order_by(Promotion.id.desc()).offset(offset).limit(limit))]
