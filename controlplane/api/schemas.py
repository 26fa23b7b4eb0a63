"""Request and response bodies of the admin API.

The operator-facing bodies are shared contracts (``adaflash.contracts.admin_api``, which
clients import too); what only nodes and learners send, and the query parameters, stay here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Query
from pydantic import BaseModel, Field

from adaflash.contracts.admin_api import (  # noqa: F401  (re-exported for the routes)
    ID_PATTERN,
    NODE_PATTERN,
    PRINTABLE,
    VERSION_PATTERN,
    ApprovalOut,
    ApproveIn,
    AuditEntryOut,
    AuditVerifyOut,
    DeletionAckIn,
    DeletionComponentOut,
    DeletionIn,
    DeletionOut,
    ErrorBody,
    EvaluationOut,
    Flag,
    GateResultOut,
    Input,
    KeyCreated,
    KeyIn,
    KeyOut,
    NodeId,
    NodeOut,
    NodeUpdate,
    Number,
    PendingPurgeOut,
    PinIn,
    PinOut,
    PredictedRealised,
    PromotionOut,
    Reason,
    ReasonIn,
    TenantId,
    TenantPolicyIn,
    Text,
    Timestamp,
    VersionDetail,
    VersionOut,
    WhoAmI,
)
from adaflash.contracts.cost_curve import CostCurve

Offset = Annotated[int, Query(ge=0, le=1_000_000_000)]
Limit = Annotated[int, Query(ge=1, le=500)]


# -- nodes -------------------------------------------------------------------------------------------
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
