"""The fleet's learning hold: pause online training and shadow evaluation, never serving.

An admin sets it (``PUT /api/v1/hold``, audited), for instance while a measurement should
have the machine to itself, and lifts it the same way. Learners read it between two steps
(``GET /api/v1/learners/{id}/hold``, every ``learner.hold_poll_s``) and take no step while
``learning`` is held; records keep arriving in their buffers, nothing is dropped for the
hold. The control plane's shadow worker starts no evaluation while ``evaluation`` is held
(one already running finishes). Rollouts and rollbacks go on.

``GET /api/v1/hold`` says when the pause has taken effect (``quiet``): every learner seen
in the last ``ACTIVE_S`` seconds has read the hold since it was set, and no version is
under evaluation.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash.contracts.admin_api import HoldOut, LearnerHoldOut
from controlplane import audit
from controlplane.db import utcnow
from controlplane.models import Hold, HoldSeen, Version
from controlplane.states import VersionState

HOLD_ID = 1
ACTIVE_S = 120.0  # a learner that read the hold more recently than this counts as running


def current(session: Session) -> Hold:
    """The hold row (not held when none was ever set)."""
    return session.get(Hold, HOLD_ID) or Hold(id=HOLD_ID, learning=False, evaluation=False)


def evaluation_held(session: Session) -> bool:
    return bool(current(session).evaluation)


def put(session: Session, *, learning: bool, evaluation: bool, reason: str, actor: str) -> Hold:
    now = utcnow()
    row = session.get(Hold, HOLD_ID)
    before = _state(row) if row else None
    if row is None:
        row = Hold(id=HOLD_ID)
        session.add(row)
    row.learning, row.evaluation, row.reason, row.set_by, row.set_at = learning, evaluation, reason, actor, now
    audit.record(session, actor=actor, action="hold.set", target="hold:fleet", before=before, after=_state(row),
                 at=now)
    return row


def seen(session: Session, learner_id: str) -> None:
    """A learner read the hold (between two of its steps): remember when."""
    session.merge(HoldSeen(learner_id=learner_id, seen_at=utcnow()))


def describe(session: Session) -> HoldOut:
    h = current(session)
    now = utcnow()
    evaluating = list(session.scalars(select(Version.version).where(
        Version.state == VersionState.evaluating.value).order_by(Version.version)))
    learners = []
    for r in session.scalars(select(HoldSeen).order_by(HoldSeen.seen_at.desc())):
        learners.append(LearnerHoldOut(learner_id=r.learner_id, seen_at=r.seen_at,
                                       quiet=bool(h.learning) and h.set_at is not None and r.seen_at >= h.set_at))
    active = [x for x in learners if now - x.seen_at <= timedelta(seconds=ACTIVE_S)]
    quiet = ((not h.evaluation or not evaluating) and (not h.learning or all(x.quiet for x in active)))
    return HoldOut(learning=bool(h.learning), evaluation=bool(h.evaluation), reason=h.reason, set_by=h.set_by,
                   set_at=h.set_at, evaluating=evaluating, learners=learners, quiet=quiet)


def _state(row: Hold) -> dict:
    return {"learning": bool(row.learning), "evaluation": bool(row.evaluation), "reason": row.reason}
