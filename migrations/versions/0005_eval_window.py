"""The control plane's copy of its shadow-evaluation window (controlplane/eval_window.py).

Held-out feedback records read for evaluation, kept so a broker restarted empty does
not empty the window; each expires at created_at + its tenant's ttl_days.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eval_window_records",
        sa.Column("record_id", sa.String(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("target_id", sa.String(length=256), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("stored_at", UTCDateTime(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("record_id"),
    )
    op.create_index("ix_eval_window_records_tenant_id", "eval_window_records", ["tenant_id"])
    op.create_index("ix_eval_window_records_created_at", "eval_window_records", ["created_at"])
    op.create_index("ix_eval_window_records_expires_at", "eval_window_records", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_eval_window_records_expires_at", table_name="eval_window_records")
    op.drop_index("ix_eval_window_records_created_at", table_name="eval_window_records")
    op.drop_index("ix_eval_window_records_tenant_id", table_name="eval_window_records")
    op.drop_table("eval_window_records")
