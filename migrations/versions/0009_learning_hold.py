"""The fleet's learning hold and when each learner last read it (controlplane/hold.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "holds",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("learning", sa.Boolean(), nullable=False),
        sa.Column("evaluation", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("set_by", sa.String(128)),
        sa.Column("set_at", UTCDateTime()),
    )
    op.create_table(
        "hold_seen",
        sa.Column("learner_id", sa.String(128), primary_key=True),
        sa.Column("seen_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("hold_seen")
    op.drop_table("holds")
