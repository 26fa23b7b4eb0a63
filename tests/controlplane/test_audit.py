"""The audit log's hash chain verifies, and any edit, deletion or truncation is found."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from controlplane import audit
from controlplane.db import make_engine, make_sessionmaker, session_scope, upgrade

DROP_GUARDS = {
    "sqlite": ["DROP TRIGGER audit_log_no_update", "DROP TRIGGER audit_log_no_delete"],
    "postgresql": ["DROP TRIGGER audit_log_append_only ON audit_log"],
}


def _db(url):
    upgrade(url)
    engine = make_engine(url)
    return engine, make_sessionmaker(engine)


def _fill(sessions, n=5):
    with session_scope(sessions) as s:
        for i in range(n):
            audit.record(s, actor="key:abc (ops)", action="version.approved", target=f"version:{i}",
                         tenant_id="acme" if i % 2 else None, before={"state": "awaiting_approval"},
                         after={"state": "approved", "at": datetime(2026, 1, 1, tzinfo=UTC), "x": 0.1 * i})


def _tamper(engine, *statements):
    """What someone with database access could do: lift the guard, then edit."""
    with engine.begin() as conn:
        for stmt in DROP_GUARDS[engine.dialect.name] + list(statements):
            conn.execute(text(stmt))


def _verify(sessions):
    with session_scope(sessions) as s:
        return audit.verify(s)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def db(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    engine, sessions = _db(url)
    yield engine, sessions
    engine.dispose()


def test_intact_chain_verifies(db):
    engine, sessions = db
    assert _verify(sessions).ok and _verify(sessions).entries == 0
    _fill(sessions)
    r = _verify(sessions)
    assert r.ok and r.entries == 5
    with session_scope(sessions) as s:
        assert [e.seq for e in audit.list_entries(s, tenant_ids=["acme"])] == [2, 4]


def test_edited_entry_is_found(db):
    engine, sessions = db
    _fill(sessions)
    _tamper(engine, "UPDATE audit_log SET actor = 'someone else' WHERE seq = 3")
    r = _verify(sessions)
    assert not r.ok and r.first_bad_seq == 3


def test_deleted_entry_is_found(db):
    engine, sessions = db
    _fill(sessions)
    _tamper(engine, "DELETE FROM audit_log WHERE seq = 2")
    r = _verify(sessions)
    assert not r.ok and r.first_bad_seq == 3


def test_truncated_tail_is_found(db):
    engine, sessions = db
    _fill(sessions)
    _tamper(engine, "DELETE FROM audit_log WHERE seq >= 4")
    r = _verify(sessions)
    assert not r.ok and r.first_bad_seq == 4 and "head" in r.reason


@pytest.mark.services
def test_concurrent_appends_stay_one_chain(pg_url):
    engine, sessions = _db(pg_url)

    def worker(k):
        for i in range(10):
            with session_scope(sessions) as s:
                audit.record(s, actor=f"w{k}", action="test.append", target=str(i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = _verify(sessions)
    engine.dispose()
    assert r.ok and r.entries == 40
