"""FeedbackRecord, schema version 1: what a serving node ships to the learner.

Scrubbed before it leaves the node. Token ids are not shipped: the learner
re-tokenizes the scrubbed text and recomputes the frozen target's distributions.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adaflash.contracts import FEEDBACK_SCHEMA_VERSION
from adaflash.contracts.tenancy import TenantId

# Held-out split of live feedback: one record in EVALUATION_MODULUS is kept for shadow
# evaluation and never trained on. The rule hashes the record id (sha256, not Python's
# salted hash()) so the learner and the control plane, in different processes, agree.
EVALUATION_MODULUS = 10


def is_evaluation_record(record_id: str) -> bool:
    """True for the records reserved for shadow evaluation: the learner must skip them.

    ``int(sha256(record_id)[:16 hex digits]) % 10 == 0``, about 10 % of records.
    """
    digest = hashlib.sha256(record_id.encode()).hexdigest()
    return int(digest[:16], 16) % EVALUATION_MODULUS == 0


class TargetRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    sha256: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(ge=0.0)
    top_p: float = Field(gt=0.0, le=1.0)


class Round(BaseModel):
    """One speculative round: verified length, accepted drafts, the head's prediction."""

    model_config = ConfigDict(extra="forbid")
    k_hat: int = Field(ge=1)
    accepted: int = Field(ge=0)
    a_hat: float = Field(ge=0.0, le=1.0)


class Stats(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau_mean: float = Field(ge=0.0)
    verify_tokens: int = Field(ge=0)
    draft_ms: float = Field(ge=0.0)
    verify_ms: float = Field(ge=0.0)


class FeedbackRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    schema_version: Literal[1] = FEEDBACK_SCHEMA_VERSION
    tenant_id: TenantId
    node_id: str
    request_id: str
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    target_model: TargetRef
    drafter_version: str
    mode: Literal["ar", "fixed", "adaptive"]
    sampling: Sampling
    domain: str | None = None
    prompt_text: str
    response_text: str
    pii: dict[str, int] = Field(default_factory=dict)
    rounds: list[Round] = Field(default_factory=list)
    stats: Stats

    @field_validator("created_at")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return v if v.tzinfo else v.replace(tzinfo=UTC)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> FeedbackRecord:
        """Parse and validate; raises ``InvalidRecord`` with a readable reason."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRecord(f"not JSON: {e}") from e
        if not isinstance(data, dict):
            raise InvalidRecord("not a JSON object")
        if data.get("schema_version") != FEEDBACK_SCHEMA_VERSION:
            raise InvalidRecord(f"unsupported schema_version {data.get('schema_version')!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidRecord(f"schema violation: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from e


class InvalidRecord(ValueError):
    """A record that does not satisfy the FeedbackRecord contract."""
