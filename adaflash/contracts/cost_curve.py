"""A node's measured cost of a step, as it travels in heartbeats and evaluation reports.

``points`` are measured step times: one verify pass over ``batch`` requests and
``tokens`` verify tokens took ``seconds`` (a moving average over ``count`` steps). The
linear coefficients are the fallback where the table has no nearby measurement (the
priors, refitted once the node has observations). ``products`` are the seconds the
target's weight products alone took for ``rows`` rows, measured once at start: extra
verify tokens never cost less than their rows' products (noisy step times can say
otherwise). ``dataplane.cost_model.CostModel`` builds and interpolates it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_COST_POINTS = 512

Seconds = Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)]


class CostPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a bool is not a count

    batch: int = Field(ge=1, le=100_000)
    tokens: int = Field(ge=1, le=10_000_000)
    seconds: Seconds
    count: int = Field(ge=1)


class ProductPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rows: int = Field(ge=1, le=10_000_000)
    seconds: Seconds


class CostCurve(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a bool is not a count

    base_s: Seconds
    per_request_s: Seconds
    per_token_s: Seconds
    draft_per_request_s: Seconds
    points: list[CostPoint] = Field(default_factory=list, max_length=MAX_COST_POINTS)
    products: list[ProductPoint] = Field(default_factory=list, max_length=64)
    observations: int = Field(default=0, ge=0)

    @property
    def measured(self) -> bool:
        """True when the node measured at least one point (else: priors only)."""
        return bool(self.points)
