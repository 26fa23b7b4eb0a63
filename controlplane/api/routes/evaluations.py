"""Shadow-evaluation reports and their plots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import FileResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash.config import Settings
from controlplane.api.deps import READ, SessionDep, allow, get_settings
from controlplane.api.schemas import VERSION_PATTERN, EvaluationOut, Limit, Offset
from controlplane.auth import Principal
from controlplane.errors import NotFound
from controlplane.models import Evaluation
from controlplane.shadow.store import evaluations_dir

router = APIRouter(prefix="/evaluations", tags=["evaluations"])
PLOT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def _out(e: Evaluation) -> EvaluationOut:
    return EvaluationOut(id=e.id, version=e.version, champion_version=e.champion_version, status=e.status,
                         report=e.report, plots=sorted(e.plots or {}), error=e.error, created_at=e.created_at,
                         completed_at=e.completed_at)


def _get(session: Session, evaluation_id: int) -> Evaluation:
    e = session.get(Evaluation, evaluation_id)
    if e is None:
        raise NotFound(f"evaluation {evaluation_id} not found")
    return e


@router.get("", response_model=list[EvaluationOut], summary="Evaluations, newest first")
def list_evaluations(version: Annotated[str | None, Query(pattern=VERSION_PATTERN)] = None,
                     limit: Limit = 50, offset: Offset = 0,
                     session: Session = SessionDep, _: Principal = Depends(allow(*READ))):
    q = select(Evaluation)
    if version:
        q = q.where(Evaluation.version == version)
    return [_out(e) for e in session.scalars(q.order_by(Evaluation.id.desc()).offset(offset).limit(limit))]


@router.get("/{evaluation_id}", response_model=EvaluationOut, summary="One evaluation with its report JSON")
def get_evaluation(evaluation_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: Session = SessionDep,
                   _: Principal = Depends(allow(*READ))):
    return _out(_get(session, evaluation_id))


@router.get("/{evaluation_id}/plots/{name}", response_class=FileResponse, summary="One plot of a report (PNG)",
            responses={200: {"content": {"image/png": {}}, "description": "the plot"}})
def get_plot(evaluation_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
             name: Annotated[str, Path(pattern=PLOT_PATTERN)], session: Session = SessionDep,
             settings: Settings = Depends(get_settings), _: Principal = Depends(allow(*READ))):
    e = _get(session, evaluation_id)
    stored = (e.plots or {}).get(name)
    if stored is None:
        raise NotFound(f"evaluation {evaluation_id} has no plot {name!r}")
    root = evaluations_dir(settings)
    path = (root / stored).resolve()
    # Stored paths are relative to the evaluations directory; never serve anything outside it.
    if not path.is_relative_to(root) or not path.is_file():
        raise NotFound(f"plot {name!r} of evaluation {evaluation_id} is missing")
    return FileResponse(path, media_type="image/png", filename=f"evaluation-{evaluation_id}-{name}.png")
