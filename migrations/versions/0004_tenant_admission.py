"""Tenant admission limits: weight, queued requests and tokens in flight per tenant.

NULL keeps the serving node's configured default (dataplane.tenant_*).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_tokens")
        batch.drop_column("max_queued")
        batch.drop_column("weight")
