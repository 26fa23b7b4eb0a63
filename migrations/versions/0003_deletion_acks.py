"""Deletion requests that execute: per-component acknowledgements and a learner role.

deletion_acks holds one row per component instance (the control plane, each node, each
learner) that purged its stores for a request, with what it purged. api_keys.role
admits ``learner`` (a learner fetches its deletion work and acknowledges it).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OLD_ROLES = "role IN ('viewer', 'approver', 'admin', 'auditor', 'node')"
NEW_ROLES = "role IN ('viewer', 'approver', 'admin', 'auditor', 'node', 'learner')"


def upgrade() -> None:
    op.create_table(
        "deletion_acks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.Integer(), nullable=False),
        sa.Column("component", sa.String(length=16), nullable=False),
        sa.Column("instance", sa.String(length=128), nullable=False),
        sa.Column("purged", sa.JSON(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("acked_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("component IN ('controlplane', 'node', 'learner')", name="ck_deletion_acks_component"),
        sa.ForeignKeyConstraint(["request_id"], ["deletion_requests.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("request_id", "component", "instance", name="uq_deletion_acks_instance"),
    )
    op.create_index("ix_deletion_acks_request_id", "deletion_acks", ["request_id"])
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("ck_api_keys_role", type_="check")
        batch.create_check_constraint("ck_api_keys_role", NEW_ROLES)


def downgrade() -> None:
    op.execute("DELETE FROM api_keys WHERE role = 'learner'")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("ck_api_keys_role", type_="check")
        batch.create_check_constraint("ck_api_keys_role", OLD_ROLES)
    op.drop_index("ix_deletion_acks_request_id", table_name="deletion_acks")
    op.drop_table("deletion_acks")
