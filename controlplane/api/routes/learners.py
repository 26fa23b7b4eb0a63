"""Learners: claims on the records they train (one learner trains each record)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from adaflash.config import Settings
from adaflash.contracts.admin_api import ClaimsIn, ClaimsOut
from controlplane import claims
from controlplane.api.deps import ADMIN, SessionDep, allow, get_settings
from controlplane.api.schemas import NODE_PATTERN
from controlplane.auth import Principal, require_node
from controlplane.states import Role

router = APIRouter(prefix="/learners", tags=["learners"])
LearnerPath = Annotated[str, Path(pattern=NODE_PATTERN)]


@router.post("/{learner_id}/claims", response_model=ClaimsOut,
             summary="A learner claims the records it is about to train and reports those it trained")
def post_claims(learner_id: LearnerPath, body: ClaimsIn, session: Session = SessionDep,
                settings: Settings = Depends(get_settings), who: Principal = Depends(allow(Role.learner, *ADMIN))):
    require_node(who, learner_id)
    cp = settings.controlplane

    def once() -> ClaimsOut:
        out = claims.claim(session, learner_id, body.claim, body.trained,
                           lease_s=cp.claim_lease_s, retention_s=cp.claim_retention_s)
        session.commit()
        return ClaimsOut(granted=out.granted, trained_elsewhere=out.trained_elsewhere,
                         held_elsewhere=out.held_elsewhere)

    try:
        return once()
    except IntegrityError:  # another learner inserted one of these records just now: its row is read
        session.rollback()
        return once()
