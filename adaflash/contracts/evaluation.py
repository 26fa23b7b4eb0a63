"""Shadow-evaluation report, schema version 1: what the evaluator writes and the gates read.

Champion and candidate are replayed on the same held-out window of scrubbed feedback.
tau is the mean number of tokens committed per speculative round (accepted drafts plus
the target's own token), so plain decoding has tau = 1.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EVALUATION_SCHEMA_VERSION = 1
THROUGHPUT_CONCURRENCIES = (1, 8, 32)


class ReliabilityBin(BaseModel):
    """Length-head calibration: predicted vs observed acceptance in one probability bin."""

    model_config = ConfigDict(extra="forbid")
    lo: float = Field(ge=0.0, le=1.0)
    hi: float = Field(ge=0.0, le=1.0)
    predicted: float = Field(ge=0.0, le=1.0)  # mean a_hat of the rounds in the bin
    observed: float = Field(ge=0.0, le=1.0)  # their realised acceptance rate
    count: int = Field(ge=0)


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mae: float = Field(ge=0.0)  # mean |predicted accepted length - realised accepted length| / block
    bins: list[ReliabilityBin] = Field(default_factory=list)
    # Expected calibration error of the head's per-position acceptance, block position 1..k-1
    # (dataplane.spec_policy.position_ece).
    position_ece: list[float] = Field(default_factory=list)


class ThroughputPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    concurrency: int = Field(ge=1)
    tokens_per_s: float = Field(ge=0.0)  # predicted from the node's measured cost curve
    tau: float | None = Field(default=None, ge=0.0)  # tau of the policy's walk at this concurrency


class DrafterMetrics(BaseModel):
    """One drafter (champion or candidate) over the whole evaluation window."""

    model_config = ConfigDict(extra="forbid")
    version: str
    tau: float = Field(ge=0.0)
    expected_tau_sampled: float | None = Field(default=None, ge=0.0)  # sampled requests only
    acceptance_by_position: list[float] = Field(default_factory=list)  # P(draft i accepted), i = 0..
    verified_per_accepted: float = Field(ge=0.0)  # verified tokens per accepted token
    calibration: Calibration | None = None
    throughput: list[ThroughputPoint] = Field(default_factory=list)

    @field_validator("acceptance_by_position")
    @classmethod
    def _probabilities(cls, v: list[float]) -> list[float]:
        if any(not 0.0 <= p <= 1.0 for p in v):
            raise ValueError("acceptance_by_position entries must lie in [0, 1]")
        return v

    @field_validator("throughput")
    @classmethod
    def _standard_points(cls, v: list[ThroughputPoint]) -> list[ThroughputPoint]:
        have = {p.concurrency for p in v}
        if v and not set(THROUGHPUT_CONCURRENCIES) <= have:
            raise ValueError(f"throughput must cover concurrencies {THROUGHPUT_CONCURRENCIES}")
        return v


class SliceMetrics(BaseModel):
    """Champion and candidate tau (and predicted tokens/s at concurrency 1) on one tenant's
    or one domain's records."""

    model_config = ConfigDict(extra="forbid")
    n_records: int = Field(ge=0)
    champion_tau: float = Field(ge=0.0)
    candidate_tau: float = Field(ge=0.0)
    champion_tps: float | None = Field(default=None, ge=0.0)
    candidate_tps: float | None = Field(default=None, ge=0.0)


class LiveShadow(BaseModel):
    """Optional: acceptance of the candidate drafted beside the champion on live traffic."""

    model_config = ConfigDict(extra="forbid")
    n_requests: int = Field(ge=0)
    champion_tau: float = Field(ge=0.0)
    candidate_tau: float = Field(ge=0.0)


class EvaluationReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = EVALUATION_SCHEMA_VERSION
    target_id: str
    candidate_version: str
    champion_version: str | None  # None: no champion yet (first candidate)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    window_start: datetime
    window_end: datetime
    n_records: int = Field(ge=0)
    n_greedy: int = Field(ge=0)
    n_sampled: int = Field(ge=0)
    champion: DrafterMetrics | None
    candidate: DrafterMetrics
    per_tenant: dict[str, SliceMetrics] = Field(default_factory=dict)
    per_domain: dict[str, SliceMetrics] = Field(default_factory=dict)
    live: LiveShadow | None = None
    # What priced the throughput: "node:<id>" (the cost curve that node measured and sent in
    # its heartbeat) or "priors" (no node had reported a measured curve).
    cost_source: str = "priors"

    @field_validator("created_at", "window_start", "window_end")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return v if v.tzinfo else v.replace(tzinfo=UTC)

    @model_validator(mode="after")
    def _consistent(self) -> EvaluationReport:
        if self.window_end < self.window_start:
            raise ValueError("window_end precedes window_start")
        if self.n_greedy + self.n_sampled != self.n_records:
            raise ValueError("n_greedy + n_sampled must equal n_records")
        if self.candidate.version != self.candidate_version:
            raise ValueError("candidate.version differs from candidate_version")
        if (self.champion is None) != (self.champion_version is None):
            raise ValueError("champion metrics and champion_version must be given together")
        if self.champion is not None and self.champion.version != self.champion_version:
            raise ValueError("champion.version differs from champion_version")
        return self
