"""Request and response bodies of the admin API.

The operator-facing bodies are shared contracts (``adaflash.contracts.admin_api``, which
clients import too); what only nodes and learners send, and the query parameters, stay here.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

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
    DesiredOut,
    ErrorBody,
    EvaluationOut,
    Flag,
    GateResultOut,
    HeartbeatIn,
    HeartbeatOut,
    HoldIn,
    HoldOut,
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

Offset = Annotated[int, Query(ge=0, le=1_000_000_000)]
Limit = Annotated[int, Query(ge=1, le=500)]


# -- nodes -------------------------------------------------------------------------------------------
