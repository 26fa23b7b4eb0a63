"""Learners' record claims: one learner trains each feedback record (controlplane/claims.py).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "record_claims",
        sa.Column("record_id", sa.String(256), primary_key=True),
        sa.Column("learner_id", sa.String(128), nullable=False),
        sa.Column("trained", sa.Boolean(), nullable=False),
        sa.Column("claimed_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_record_claims_claimed_at", "record_claims", ["claimed_at"])


def downgrade() -> None:
    op.drop_index("ix_record_claims_claimed_at", table_name="record_claims")
    op.drop_table("record_claims")
