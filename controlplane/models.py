"""SQLAlchemy models of the control-plane database (the schema itself is Alembic's)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from controlplane.db import UTCDateTime, utcnow
from controlplane.states import (
    DeletionComponent,
    DeletionScope,
    DeletionState,
    NodeRole,
    PromotionKind,
    PromotionState,
    Role,
    VersionState,
)

VERSION_LEN = 64
ID_LEN = 256  # record and target ids kept in the evaluation window copy


def _in(column: str, enum) -> str:
    return f"{column} IN ({', '.join(repr(m.value) for m in enum)})"


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Version(Base):
    """A drafter version of the registered model, and where it is in its lifecycle."""

    __tablename__ = "versions"
    __table_args__ = (CheckConstraint(_in("state", VersionState), name="ck_versions_state"),)

    version: Mapped[str] = mapped_column(String(VERSION_LEN), primary_key=True)
    target_id: Mapped[str] = mapped_column(String(256))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    source_uri: Mapped[str] = mapped_column(Text)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(32), index=True, default=VersionState.registered.value)
    state_reason: Mapped[str | None] = mapped_column(Text)
    lineage: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    state_changed_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    # Shadow-predicted tau and tokens/s (concurrency 1) of its evaluation, and the mean of the
    # live tau / tokens/s / requests in flight that nodes serving it report (controlplane/fleet.py).
    predicted_tau: Mapped[float | None] = mapped_column(Float)
    predicted_tps: Mapped[float | None] = mapped_column(Float)
    realised_tau: Mapped[float | None] = mapped_column(Float)
    realised_tps: Mapped[float | None] = mapped_column(Float)
    realised_load: Mapped[float | None] = mapped_column(Float)
    realised_samples: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    realised_at: Mapped[datetime | None]


class Alias(Base):
    """Desired-state pointers `champion` and `previous` (mirrored to MLflow aliases)."""

    __tablename__ = "aliases"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    version: Mapped[str] = mapped_column(ForeignKey("versions.version"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (CheckConstraint(_in("role", NodeRole), name="ck_nodes_role"),)

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(String(512), default="")
    role: Mapped[str] = mapped_column(String(16), default=NodeRole.regular.value)
    desired_version: Mapped[str | None] = mapped_column(ForeignKey("versions.version"))
    pinned_version: Mapped[str | None] = mapped_column(ForeignKey("versions.version"))
    served_version: Mapped[str | None] = mapped_column(String(VERSION_LEN))
    last_heartbeat_at: Mapped[datetime | None]
    heartbeats: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # ever received
    live_tau: Mapped[float | None] = mapped_column(Float)
    live_tps: Mapped[float | None] = mapped_column(Float)
    error_rate: Mapped[float | None] = mapped_column(Float)
    live_load: Mapped[float | None] = mapped_column(Float)  # requests in flight at the last heartbeat
    # tau / TPS per load bucket while serving one version (controlplane/canary_judge.py)
    load_profile: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The measured cost curve of its last heartbeat (adaflash.contracts.cost_curve.CostCurve)
    cost_curve: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    cost_curve_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(32), default="unknown")  # as the node reports it
    status_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Evaluation(Base):
    __tablename__ = "evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(ForeignKey("versions.version"), index=True)
    champion_version: Mapped[str | None] = mapped_column(String(VERSION_LEN))
    status: Mapped[str] = mapped_column(String(16), default="running")  # running | completed | failed
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    plots: Mapped[dict[str, Any]] = mapped_column(default=dict)  # name -> path under evaluations_dir
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None]


class GateResultRow(Base):
    __tablename__ = "gate_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(ForeignKey("versions.version"), index=True)
    evaluation_id: Mapped[int | None] = mapped_column(ForeignKey("evaluations.id"))
    policy_version: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(64))
    passed: Mapped[bool] = mapped_column(Boolean)
    value: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Promotion(Base):
    """One rollout, as a resumable state machine (see ``controlplane.states.PromotionState``)."""

    __tablename__ = "promotions"
    __table_args__ = (
        CheckConstraint(_in("state", PromotionState), name="ck_promotions_state"),
        CheckConstraint(_in("kind", PromotionKind), name="ck_promotions_kind"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    version: Mapped[str] = mapped_column(ForeignKey("versions.version"), index=True)  # going in
    from_version: Mapped[str | None] = mapped_column(ForeignKey("versions.version"))  # going out
    state: Mapped[str] = mapped_column(String(16), index=True, default=PromotionState.pending.value)
    canary_nodes: Mapped[list[Any]] = mapped_column(default=list)
    watch_until: Mapped[datetime | None]
    reason: Mapped[str | None] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(256))
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # times a reconciler entered the state
    lease_owner: Mapped[str | None] = mapped_column(String(128))  # reconciler holding it
    lease_until: Mapped[datetime | None]
    # Live metrics before the rollout acted, and the canaries' heartbeat counts when watching began.
    baseline: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Approval(Base):
    __tablename__ = "approvals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(ForeignKey("versions.version"), index=True)
    decision: Mapped[str] = mapped_column(String(16))  # approved | rejected
    actor: Mapped[str] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(Text, default="")
    policy_version: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Tenant(Base):
    """Stored ``adaflash.contracts.tenancy.TenantPolicy`` fields."""

    __tablename__ = "tenants"

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    sampling_rate: Mapped[float] = mapped_column(Float)
    opt_out: Mapped[bool] = mapped_column(Boolean)
    ttl_days: Mapped[float] = mapped_column(Float)
    share_cap: Mapped[float] = mapped_column(Float)
    weight: Mapped[float | None] = mapped_column(Float)  # admission; NULL: the node's default
    max_queued: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """A bearer key: only a salted hash of its secret is kept."""

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_in("role", Role), name="ck_api_keys_role"),)

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public part of the key
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    tenants: Mapped[list[Any]] = mapped_column(default=list)  # auditor scope
    node_id: Mapped[str | None] = mapped_column(String(128))  # node keys: the only node it speaks for
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_by: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class DeletionRequest(Base):
    __tablename__ = "deletion_requests"
    __table_args__ = (
        CheckConstraint(_in("state", DeletionState), name="ck_deletion_requests_state"),
        CheckConstraint(_in("scope", DeletionScope), name="ck_deletion_requests_scope"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    scope: Mapped[str] = mapped_column(String(16))
    ids: Mapped[list[Any]] = mapped_column(default=list)
    reason: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default=DeletionState.pending.value)
    requested_by: Mapped[str] = mapped_column(String(256))
    result: Mapped[dict[str, Any]] = mapped_column(default=dict)  # per store: what was purged
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None]


class DeletionAck(Base):
    """One component's acknowledgement of a deletion request: what it purged, when."""

    __tablename__ = "deletion_acks"
    __table_args__ = (
        CheckConstraint(_in("component", DeletionComponent), name="ck_deletion_acks_component"),
        UniqueConstraint("request_id", "component", "instance", name="uq_deletion_acks_instance"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("deletion_requests.id"), index=True)
    component: Mapped[str] = mapped_column(String(16))
    instance: Mapped[str] = mapped_column(String(128))  # node id, learner id, "controlplane"
    purged: Mapped[dict[str, Any]] = mapped_column(default=dict)  # store -> records deleted
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)  # failures, trained-in weights, ...
    actor: Mapped[str] = mapped_column(String(256))
    acked_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEntry(Base):
    """Append-only and hash-chained (database triggers refuse UPDATE and DELETE)."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_tenant_seq", "tenant_id", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    tenant_id: Mapped[str | None] = mapped_column(String(128))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AuditHead(Base):
    """The chain's tip (one row). Appenders lock it first, so appends are serialised and
    truncating the log's tail is detected by verification."""

    __tablename__ = "audit_head"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(Integer)
    hash: Mapped[str] = mapped_column(String(64))


class EvalWindowRecord(Base):
    """A held-out feedback record the control plane read for shadow evaluation (its own copy,
    controlplane/eval_window.py); expires at created_at + its tenant's ttl_days."""

    __tablename__ = "eval_window_records"

    record_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    target_id: Mapped[str] = mapped_column(String(ID_LEN))
    created_at: Mapped[datetime] = mapped_column(index=True)
    expires_at: Mapped[datetime] = mapped_column(index=True)
    stored_at: Mapped[datetime] = mapped_column()
    body: Mapped[str] = mapped_column(Text)  # the FeedbackRecord as JSON (scrubbed at the node)


class RecordClaim(Base):
    """A learner's hold on a feedback record it trains (controlplane/claims.py): across the
    learner group, each record is trained by one learner even when a broker that came back
    empty hands records already trained to another."""

    __tablename__ = "record_claims"

    record_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)  # SHA-256 of the id, hex
    learner_id: Mapped[str] = mapped_column(String(128))
    trained: Mapped[bool] = mapped_column(default=False)
    claimed_at: Mapped[datetime] = mapped_column(index=True)


class Hold(Base):
    """The fleet's learning hold (controlplane/hold.py): one row, id 1, written by an admin."""

    __tablename__ = "holds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    learning: Mapped[bool] = mapped_column(default=False)
    evaluation: Mapped[bool] = mapped_column(default=False)
    reason: Mapped[str | None] = mapped_column(Text)
    set_by: Mapped[str | None] = mapped_column(String(128))
    set_at: Mapped[datetime | None] = mapped_column()


class HoldSeen(Base):
    """When each learner last read the hold, between two of its steps."""

    __tablename__ = "hold_seen"

    learner_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column()
