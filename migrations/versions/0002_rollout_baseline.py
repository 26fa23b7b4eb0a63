"""Rollout bookkeeping: a heartbeat counter per node and a promotion's live baseline.

nodes.heartbeats counts every heartbeat a node ever sent, so the rollout reconciler can
tell how many arrived inside a watch window without keeping history.
promotions.baseline holds the live tau / TPS / error rate measured before the rollout
acted, and the canaries' heartbeat counts when watching began.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("heartbeats", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("promotions") as batch:
        batch.add_column(sa.Column("baseline", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("promotions") as batch:
        batch.drop_column("baseline")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("heartbeats")
