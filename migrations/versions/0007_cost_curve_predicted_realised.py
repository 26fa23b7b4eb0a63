"""Measured cost curves in heartbeats; shadow-predicted against realised live figures per version.

nodes.cost_curve holds the cost curve (adaflash.contracts.cost_curve.CostCurve) a node
sent with its last heartbeat; shadow evaluation prices throughput with the newest one.
versions.predicted_* are the shadow evaluation's tau and tokens/s (concurrency 1) of the
version; versions.realised_* the mean of what nodes serving it report in heartbeats
(tau, tokens/s, requests in flight), over realised_samples heartbeats.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

from controlplane.db import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

VERSION_COLUMNS = ("predicted_tau", "predicted_tps", "realised_tau", "realised_tps", "realised_load")


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("cost_curve", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("cost_curve_at", UTCDateTime(), nullable=True))
    with op.batch_alter_table("versions") as batch:
        for name in VERSION_COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("realised_samples", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("realised_at", UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("realised_at")
        batch.drop_column("realised_samples")
        for name in reversed(VERSION_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("cost_curve_at")
        batch.drop_column("cost_curve")
