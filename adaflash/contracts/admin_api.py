"""The admin API's request and response bodies: the control plane serves them, clients read them.

Declared here, in the shared contracts, so that the control plane's routes and every
client (the operator CLI, the console's tests, later nodes and learners) use the same
models; ``controlplane.api.schemas`` imports them.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator

from adaflash.contracts.cost_curve import CostCurve
from adaflash.contracts.tenancy import TENANT_ID_PATTERN

ID_PATTERN = TENANT_ID_PATTERN  # tenant ids, and component names that follow the same rule
VERSION_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
NODE_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class NodeRole(StrEnum):
    canary = "canary"
    regular = "regular"


class Role(StrEnum):
    viewer = "viewer"
    approver = "approver"
    admin = "admin"
    auditor = "auditor"  # read-only, limited to its tenants
    node = "node"  # heartbeat, desired version, tenant policies, its deletion work and acks
    learner = "learner"  # its deletion work and acks only


class DeletionState(StrEnum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"


class DeletionScope(StrEnum):
    tenant = "tenant"  # everything the platform holds for the tenant
    requests = "requests"  # records of the listed request ids
    records = "records"  # the listed record ids


# No control characters apart from tab and newlines: PostgreSQL refuses NUL in text, and
# the rest have no business in reasons and names. A pattern, so the OpenAPI document says so.
PRINTABLE = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
Text = Annotated[str, Field(pattern=PRINTABLE)]
Reason = Annotated[str, Field(min_length=1, max_length=2000, pattern=PRINTABLE)]
TenantId = Annotated[str, Field(pattern=ID_PATTERN)]
NodeId = Annotated[str, Field(pattern=NODE_PATTERN)]
# No quiet coercion of JSON values: false is not 0.0, "1" is not true, 0 is not a date.
Number = Annotated[float, Strict()]
Flag = Annotated[bool, Strict()]


def _iso_string(v):
    if v is not None and not isinstance(v, str):
        raise ValueError("expected an ISO 8601 date-time string")
    return v


Timestamp = Annotated[AwareDatetime, BeforeValidator(_iso_string)]


class Input(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorBody(BaseModel):
    error: str
    message: str
    details: list[dict[str, Any]] | None = None


class WhoAmI(BaseModel):
    actor: str
    role: Role
    tenants: list[str]
    node_id: str | None


class VersionOut(BaseModel):
    version: str
    target_id: str
    state: str
    state_reason: str | None
    mlflow_run_id: str | None
    source_uri: str
    manifest_sha256: str | None
    lineage: dict[str, Any]
    created_at: datetime
    state_changed_at: datetime
    expires_at: datetime | None
    aliases: list[str] = []


class GateResultOut(BaseModel):
    name: str
    passed: bool
    value: float | None
    threshold: float | None
    reason: str
    policy_version: str
    evaluation_id: int | None
    created_at: datetime


class ApprovalOut(BaseModel):
    decision: str
    actor: str
    reason: str
    policy_version: str | None
    created_at: datetime


class PromotionOut(BaseModel):
    id: int
    kind: str
    version: str
    from_version: str | None
    state: str
    canary_nodes: list[str]
    watch_until: datetime | None
    reason: str | None
    requested_by: str
    created_at: datetime
    updated_at: datetime


class PredictedRealised(BaseModel):
    """Shadow-predicted against realised live figures of a version.

    predicted_*: its shadow evaluation (tau; tokens/s at concurrency 1 under the node's
    measured cost curve). realised_*: the mean of the live tau, tokens/s and requests in
    flight that nodes serving it reported, over ``realised_samples`` heartbeats.
    tau_ratio = realised_tau / predicted_tau."""

    predicted_tau: float | None = None
    predicted_tps: float | None = None
    realised_tau: float | None = None
    realised_tps: float | None = None
    realised_load: float | None = None
    realised_samples: int = 0
    realised_at: datetime | None = None
    tau_ratio: float | None = None


class VersionDetail(VersionOut):
    gate_results: list[GateResultOut]
    approvals: list[ApprovalOut]
    evaluation_ids: list[int]
    promotions: list[PromotionOut]
    figures: PredictedRealised = PredictedRealised()


class ApproveIn(Input):
    reason: Annotated[str, Field(max_length=2000, pattern=PRINTABLE)] = ""


class ReasonIn(Input):
    reason: Reason


class PinIn(Input):
    node_ids: list[NodeId] = Field(default_factory=list, max_length=1000)  # empty: every node
    reason: Reason


class PinOut(BaseModel):
    version: str
    nodes: list[str]


class EvaluationOut(BaseModel):
    id: int
    version: str
    champion_version: str | None
    status: str
    report: dict[str, Any] | None
    plots: list[str]
    error: str | None
    created_at: datetime
    completed_at: datetime | None


class NodeOut(BaseModel):
    node_id: str
    url: str
    role: str
    desired_version: str | None
    pinned_version: str | None
    served_version: str | None
    last_heartbeat_at: datetime | None
    live_tau: float | None
    live_tps: float | None
    error_rate: float | None
    status: str
    status_message: str | None
    stale: bool


class NodeUpdate(Input):
    role: NodeRole


class TenantPolicyIn(Input):
    """A tenant's policy without its id (the id is in the path)."""

    sampling_rate: Number = Field(default=1.0, ge=0.0, le=1.0)
    opt_out: Flag = False
    ttl_days: Number = Field(default=30.0, gt=0.0, le=36500.0)
    share_cap: Number = Field(default=0.5, gt=0.0, le=1.0)
    # Serving admission on the nodes; null: the node's defaults (dataplane.tenant_*).
    weight: Number | None = Field(default=None, gt=0.0, le=1000.0)
    max_queued: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=1_000_000)
    max_tokens: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=1_000_000_000)


class DeletionIn(Input):
    tenant_id: TenantId
    scope: DeletionScope = DeletionScope.tenant
    ids: list[Annotated[str, Field(min_length=1, max_length=256, pattern=PRINTABLE)]] = Field(
        default_factory=list, max_length=10000)
    reason: Reason = "deletion requested"

    @model_validator(mode="after")
    def _ids_fit_scope(self) -> DeletionIn:
        if self.scope == DeletionScope.tenant and self.ids:
            raise ValueError("scope 'tenant' deletes everything of the tenant and takes no ids")
        if self.scope != DeletionScope.tenant and not self.ids:
            raise ValueError(f"scope {self.scope.value!r} needs at least one id")
        return self


class DeletionComponentOut(BaseModel):
    component: str
    instance: str
    state: Literal["acked", "waiting"]
    purged: dict[str, int]
    detail: dict[str, Any]
    acked_at: datetime | None


class PendingPurgeOut(BaseModel):
    store: str  # kafka:<topic>
    reason: str
    gone_by: datetime
    retention_ms: int
    segment_ms: int


class DeletionAckIn(Input):
    """A node's or learner's report that it purged the request's tenant from its stores."""

    component: Literal["node", "learner"]
    instance: NodeId  # the node id, or the learner's learner_id
    purged: dict[Annotated[str, Field(pattern=ID_PATTERN)], Annotated[int, Strict(), Field(ge=0)]] = Field(
        default_factory=dict, max_length=64)
    detail: dict[Annotated[str, Field(pattern=ID_PATTERN)], Any] = Field(default_factory=dict, max_length=64)


class DeletionOut(BaseModel):
    id: int
    tenant_id: str
    scope: DeletionScope
    ids: list[str]
    reason: str
    state: DeletionState
    requested_by: str
    result: dict[str, Any]
    created_at: datetime
    completed_at: datetime | None
    components: list[DeletionComponentOut] = Field(default_factory=list)
    waiting_for: list[str] = Field(default_factory=list)  # component:instance not acknowledged yet
    pending: list[PendingPurgeOut] = Field(default_factory=list)  # purged only by time (Kafka)
    complete_by: datetime | None = None  # when the last copy is gone (provisional until all acked)
    provisional: bool = False
    trained_in_candidates: list[dict[str, Any]] = Field(default_factory=list)


class AuditEntryOut(BaseModel):
    seq: int
    at: datetime
    actor: str
    action: str
    target: str
    tenant_id: str | None
    before: Any
    after: Any
    prev_hash: str
    hash: str


class AuditVerifyOut(BaseModel):
    ok: bool
    entries: int
    first_bad_seq: int | None
    reason: str


class KeyIn(Input):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=PRINTABLE)]
    role: Role
    tenants: list[TenantId] = Field(default_factory=list, max_length=1000)  # auditors only
    node_id: NodeId | None = None  # node keys only
    expires_at: Timestamp | None = None


class KeyOut(BaseModel):
    key_id: str
    name: str
    role: Role
    tenants: list[str]
    node_id: str | None
    created_by: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The secret key. Shown once; store it now.")


# -- node heartbeats: POST /nodes/{id}/heartbeat ------------------------------------------------------
class HeartbeatIn(Input):
    served_version: Annotated[str, Field(pattern=VERSION_PATTERN)] | None = None
    url: Annotated[str, Field(max_length=512, pattern=PRINTABLE)] = ""
    live_tau: Number | None = Field(default=None, ge=0.0)
    live_tps: Number | None = Field(default=None, ge=0.0)
    error_rate: Number | None = Field(default=None, ge=0.0, le=1.0)
    live_load: Number | None = Field(default=None, ge=0.0, le=1e6)  # requests in flight
    status: Literal["ready", "loading", "degraded", "error"] = "ready"
    message: Annotated[str, Field(max_length=2000, pattern=PRINTABLE)] | None = None
    cost_curve: CostCurve | None = None  # the node's measured step times (dataplane/cost_model.py)


class DesiredOut(BaseModel):
    version: str
    uri: str
    sha256: str | None


class HeartbeatOut(BaseModel):
    node_id: str
    desired: DesiredOut | None


# -- learners' record claims: POST /learners/{id}/claims ----------------------------------------------
RecordId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")]


class ClaimsIn(Input):
    """A learner asks to train ``claim`` (records it is about to train) and reports ``trained``
    (records it checkpointed as trained). Granted: nobody else holds the record, or only a
    claim that lapsed without being reported trained."""

    claim: list[RecordId] = Field(default_factory=list, max_length=10_000)
    trained: list[RecordId] = Field(default_factory=list, max_length=10_000)


class ClaimsOut(BaseModel):
    granted: list[str]
    trained_elsewhere: dict[str, str]  # record id -> the learner that trained it: never train it
    held_elsewhere: dict[str, str]  # record id -> the learner whose claim is live: ask again later


# -- the learning hold: GET/PUT /hold, GET /learners/{id}/hold ------------------------------------------
class HoldIn(Input):
    """Pause online training (``learning``: learners take no step) and/or shadow evaluation
    (``evaluation``: no new candidate is evaluated) across the fleet, e.g. while a measurement
    runs. Serving, rollouts and rollbacks are never held."""

    learning: Flag
    evaluation: Flag
    reason: Reason


class LearnerHoldOut(BaseModel):
    learner_id: str
    seen_at: datetime  # when the learner last read the hold (between two steps)
    quiet: bool  # it read the current learning hold: it takes no step until the hold is lifted


class HoldOut(BaseModel):
    learning: bool
    evaluation: bool
    reason: str | None
    set_by: str | None
    set_at: datetime | None
    evaluating: list[str]  # versions under shadow evaluation right now (one finishes even when held)
    learners: list[LearnerHoldOut]  # learners that have read the hold, last read first
    quiet: bool  # what is held has stopped: no evaluation running (if held), every learner quiet (if held)
