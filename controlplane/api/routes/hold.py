"""The fleet's learning hold (controlplane/hold.py): read it, set or lift it, learners read it."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from controlplane import hold
from controlplane.api.deps import ADMIN, READ, SessionDep, allow
from controlplane.api.routes.learners import LearnerPath
from controlplane.api.schemas import HoldIn, HoldOut
from controlplane.auth import Principal, require_node
from controlplane.states import Role

router = APIRouter(prefix="/hold", tags=["hold"])
learner_router = APIRouter(prefix="/learners", tags=["learners"])


@router.get("", response_model=HoldOut,
            summary="The learning hold, and whether it has taken effect (every learner read it, no evaluation running)")
def get_hold(session: Session = SessionDep, who: Principal = Depends(allow(Role.auditor, *READ))):
    return hold.describe(session)


@router.put("", response_model=HoldOut,
            summary="Pause (or resume) online training and shadow evaluation across the fleet; serving, rollouts "
                    "and rollbacks are never held")
def put_hold(body: HoldIn, session: Session = SessionDep, who: Principal = Depends(allow(*ADMIN))):
    hold.put(session, learning=body.learning, evaluation=body.evaluation, reason=body.reason, actor=who.actor)
    session.commit()
    return hold.describe(session)


@learner_router.get("/{learner_id}/hold", response_model=HoldOut,
                    summary="A learner reads the hold between two steps (the read is remembered)")
def learner_hold(learner_id: LearnerPath, session: Session = SessionDep,
                 who: Principal = Depends(allow(Role.learner, *ADMIN))):
    require_node(who, learner_id)
    hold.seen(session, learner_id)
    session.commit()
    return hold.describe(session)
