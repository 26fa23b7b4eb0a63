"""Alembic owns the schema: it matches the models on SQLite and PostgreSQL, and it is reversible."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError

from controlplane.db import downgrade, make_engine, upgrade
from controlplane.models import Base
from governance.audit import GENESIS

TABLES = {"nodes", "versions", "aliases", "evaluations", "gate_results", "promotions", "approvals", "tenants",
          "api_keys", "deletion_requests", "deletion_acks", "audit_log", "audit_head", "eval_window_records"}


def _check(url: str) -> None:
    upgrade(url)
    upgrade(url)  # a second run is a no-op
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert TABLES <= set(inspect(conn).get_table_names())
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            assert diff == [], f"models and migrations disagree: {diff}"
            assert conn.execute(text("SELECT seq, hash FROM audit_head")).all() == [(0, GENESIS)]
        # The audit log refuses updates and deletes at the database level.
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO audit_log (seq, at, actor, action, target, prev_hash, hash) "
                              "VALUES (1, '2026-01-01 00:00:00', 'a', 'b', 'c', :h, :h)"), {"h": GENESIS})
        for stmt in ("UPDATE audit_log SET actor = 'x'", "DELETE FROM audit_log"):
            with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
                conn.execute(text(stmt))
        downgrade(url)
        with engine.connect() as conn:
            assert not TABLES & set(inspect(conn).get_table_names())
        upgrade(url)
    finally:
        engine.dispose()


def test_sqlite(tmp_path):
    _check(f"sqlite:///{tmp_path / 'cp.db'}")


@pytest.mark.services
def test_postgresql(pg_url):
    _check(pg_url)
