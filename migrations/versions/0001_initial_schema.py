"""Initial schema: every control-plane table, the audit chain's head and its
append-only triggers.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

GENESIS = "0" * 64  # governance.audit.GENESIS, frozen here as migrations must not change


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=False),
        sa.Column("node_id", sa.String(length=128), nullable=True),
        sa.Column("salt", sa.String(length=64), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_by", sa.String(length=256), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "role IN ('viewer', 'approver', 'admin', 'auditor', 'node')", name="ck_api_keys_role"
        ),
        sa.PrimaryKeyConstraint("key_id"),
    )
    op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "audit_log",
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=True),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_audit_log_tenant_seq", "audit_log", ["tenant_id", "seq"])

    op.create_table(
        "deletion_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("ids", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("requested_by", sa.String(length=256), nullable=False),
        sa.Column("result", sa.JSON(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("completed_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("scope IN ('tenant', 'requests', 'records')", name="ck_deletion_requests_scope"),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'completed', 'failed')", name="ck_deletion_requests_state"
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_deletion_requests_tenant_id", "deletion_requests", ["tenant_id"])

    op.create_table(
        "tenants",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("sampling_rate", sa.Float(), nullable=False),
        sa.Column("opt_out", sa.Boolean(), nullable=False),
        sa.Column("ttl_days", sa.Float(), nullable=False),
        sa.Column("share_cap", sa.Float(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    op.create_table(
        "versions",
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("target_id", sa.String(length=256), nullable=False),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("source_uri", sa.Text(), nullable=False),
        sa.Column("manifest_sha256", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.Column("lineage", sa.JSON(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("state_changed_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "state IN ('registered', 'evaluating', 'gate_failed', 'awaiting_approval', 'approved', 'canary', 'champion', 'retired', 'rejected', 'expired', 'rolled_back')",
            name="ck_versions_state",
        ),
        sa.PrimaryKeyConstraint("version"),
    )
    op.create_index("ix_versions_state", "versions", ["state"])

    op.create_table(
        "aliases",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "approvals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.String(length=64), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_approvals_version", "approvals", ["version"])

    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("champion_version", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("plots", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("completed_at", UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_evaluations_version", "evaluations", ["version"])

    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("desired_version", sa.String(length=64), nullable=True),
        sa.Column("pinned_version", sa.String(length=64), nullable=True),
        sa.Column("served_version", sa.String(length=64), nullable=True),
        sa.Column("last_heartbeat_at", UTCDateTime(), nullable=True),
        sa.Column("live_tau", sa.Float(), nullable=True),
        sa.Column("live_tps", sa.Float(), nullable=True),
        sa.Column("error_rate", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("role IN ('canary', 'regular')", name="ck_nodes_role"),
        sa.ForeignKeyConstraint(
            ["desired_version"],
            ["versions.version"],
        ),
        sa.ForeignKeyConstraint(
            ["pinned_version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("node_id"),
    )
    op.create_table(
        "promotions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("from_version", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("canary_nodes", sa.JSON(), nullable=False),
        sa.Column("watch_until", UTCDateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("requested_by", sa.String(length=256), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_until", UTCDateTime(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("kind IN ('promote', 'rollback')", name="ck_promotions_kind"),
        sa.CheckConstraint(
            "state IN ('pending', 'canary', 'watching', 'rolling_out', 'rolling_back', 'completed', 'rolled_back', 'aborted')",
            name="ck_promotions_state",
        ),
        sa.ForeignKeyConstraint(
            ["from_version"],
            ["versions.version"],
        ),
        sa.ForeignKeyConstraint(
            ["version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_promotions_state", "promotions", ["state"])
    op.create_index("ix_promotions_version", "promotions", ["version"])

    op.create_table(
        "gate_results",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("evaluation_id", sa.Integer(), nullable=True),
        sa.Column("policy_version", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["evaluation_id"],
            ["evaluations.id"],
        ),
        sa.ForeignKeyConstraint(
            ["version"],
            ["versions.version"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_gate_results_version", "gate_results", ["version"])
    op.bulk_insert(
        sa.table(
            "audit_head",
            sa.column("id", sa.Integer),
            sa.column("seq", sa.Integer),
            sa.column("hash", sa.String),
        ),
        [{"id": 1, "seq": 0, "hash": GENESIS}],
    )
    _append_only_triggers()


def _append_only_triggers() -> None:
    """UPDATE and DELETE on audit_log fail: the log is append-only at the database too."""
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_log_no_{verb.lower()} BEFORE {verb} ON audit_log "
                f"BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END"
            )
    elif dialect == "postgresql":
        op.execute(
            "CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN RAISE EXCEPTION 'audit_log is append-only'; END $$"
        )
        op.execute(
            "CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log "
            "FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()"
        )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS audit_log_no_update")
        op.execute("DROP TRIGGER IF EXISTS audit_log_no_delete")
    elif dialect == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS audit_log_append_only ON audit_log")
        op.execute("DROP FUNCTION IF EXISTS audit_log_append_only()")
    for table in (
        "gate_results",
        "promotions",
        "nodes",
        "evaluations",
        "approvals",
        "aliases",
        "versions",
        "tenants",
        "deletion_requests",
        "audit_log",
        "audit_head",
        "api_keys",
    ):
        op.drop_table(table)
