"""Load-aware rollout judgement: each node's requests in flight and its load profile.

nodes.live_load is the load a node reported with its last heartbeat; nodes.load_profile
holds its tau / TPS per load bucket while serving one version (controlplane/canary_judge.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("live_load", sa.Float(), nullable=True))
        batch.add_column(sa.Column("load_profile", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("load_profile")
        batch.drop_column("live_load")
