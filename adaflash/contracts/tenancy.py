"""Per-tenant governance policy: stored by the control plane, read by nodes and learner."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TENANT = "default"

# A tenant id: HTTP header, Kafka key, path segment, file-name part, metric label. The one
# rule every part validates with (serving API, emitter, feedback records, admin API).
TENANT_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
TENANT_ID_RULE = "1-128 characters of letters, digits, '.', '_' or '-'"
TENANT_ID_RE = re.compile(TENANT_ID_PATTERN)
TenantId = Annotated[str, Field(min_length=1, max_length=128, pattern=TENANT_ID_PATTERN)]


def valid_tenant_id(tenant_id: object) -> bool:
    """Whether ``tenant_id`` is a string that follows ``TENANT_ID_PATTERN``."""
    return isinstance(tenant_id, str) and TENANT_ID_RE.fullmatch(tenant_id) is not None


class TenantPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: TenantId
    sampling_rate: float = Field(default=1.0, ge=0.0, le=1.0)  # share of finished requests that emit
    opt_out: bool = False  # never emit feedback
    ttl_days: float = Field(default=30.0, gt=0.0)  # feedback retention everywhere
    share_cap: float = Field(default=0.5, gt=0.0, le=1.0)  # max share of one training buffer
    # Serving admission (dataplane/admission.py); None: the node's dataplane.tenant_* defaults.
    weight: float | None = Field(default=None, gt=0.0, le=1000.0)  # share of the node under contention
    max_queued: int | None = Field(default=None, ge=0)  # requests waiting for admission (0: no limit)
    max_tokens: int | None = Field(default=None, ge=0)  # prompt + max_tokens in flight (0: no limit)
