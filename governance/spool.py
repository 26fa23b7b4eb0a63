"""Durable local spool: scrubbed feedback waiting for the broker.

SQLite in WAL mode with ``synchronous=FULL`` (a record acknowledged by ``append`` is on
disk) and ``secure_delete`` (purged rows are overwritten, not left in free pages).
Rows come back in insertion order (FIFO), which keeps each tenant's records in order.

Bounded by ``max_records``. When full, ``overflow`` decides:

- ``"drop_oldest"`` (default): the new record is stored and the oldest one is dropped.
  Online learning values fresh traffic most, and the oldest records are the closest to
  their TTL. Each dropped record is counted (reason ``spool_overflow``) and reported to
  ``on_drop(tenant_id, reason)``.
- ``"refuse"``: the new record is not stored, counted as ``spool_full``.

Only ``ScrubbedRecord`` objects are accepted: raw text never reaches this file.

Deletion: ``purge_tenant`` deletes a tenant's rows (overwritten on disk, the WAL
checkpointed and truncated); ``refuse_before(tenant, t)`` makes the spool refuse that
tenant's records created up to ``t`` from then on (counted as ``deleted``), so a batch
that was in flight during the purge cannot bring them back.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from governance.pii import ScrubbedRecord

Overflow = Literal["drop_oldest", "refuse"]

REASON_OVERFLOW = "spool_overflow"
REASON_FULL = "spool_full"
REASON_DELETED = "deleted"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id TEXT NOT NULL,
    record_id TEXT NOT NULL,
    value BLOB NOT NULL,
    traceparent TEXT,
    spooled_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS spool_tenant ON spool(tenant_id);
"""


@dataclass(frozen=True)
class SpoolEntry:
    seq: int
    tenant_id: str
    record_id: str
    value: bytes  # FeedbackRecord JSON (scrubbed)
    traceparent: str | None


class Spool:
    """A bounded FIFO of scrubbed records on SQLite. Thread-safe."""

    name = "spool"

    def __init__(self, path: str | Path, max_records: int = 100_000, overflow: Overflow = "drop_oldest",
                 on_drop: Callable[[str, str], None] | None = None):
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        if overflow not in ("drop_oldest", "refuse"):
            raise ValueError(f"unknown overflow policy {overflow!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_records = max_records
        self.overflow = overflow
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA secure_delete=ON")
        self._db.executescript(_SCHEMA)
        self._count = self._db.execute("SELECT COUNT(*) FROM spool").fetchone()[0]
        self.counters: dict[str, int] = {"appended": 0, "replayed": 0, REASON_OVERFLOW: 0, REASON_FULL: 0,
                                         "purged": 0, REASON_DELETED: 0}
        self._refuse: dict[str, datetime] = {}  # tenant -> records created up to it are refused

    def __len__(self) -> int:
        return self._count

    def append(self, record: ScrubbedRecord, traceparent: str | None = None) -> bool:
        """Store one record; False if refused (full, ``refuse`` policy)."""
        return self.append_many([(record, traceparent)]) == 1

    def append_many(self, items: Iterable[tuple[ScrubbedRecord, str | None]], front: bool = False) -> int:
        """Store records in order, in one transaction; returns how many were stored.

        ``front``: ahead of every record held (records older than those, sent again)."""
        rows = []
        deleted: list[str] = []
        now = time.time()
        for rec, tp in items:
            if not isinstance(rec, ScrubbedRecord):
                raise TypeError("the spool holds scrubbed records only (governance.pii.ScrubbedRecord)")
            cutoff = self._refuse.get(rec.tenant_id)
            if cutoff is not None and rec.record.created_at <= cutoff:
                deleted.append(rec.tenant_id)
                continue
            rows.append((rec.tenant_id, rec.record_id, rec.record.to_bytes(), tp, now))
        if deleted:
            self.counters[REASON_DELETED] += len(deleted)
            if self.on_drop:
                for t in deleted:
                    self.on_drop(t, REASON_DELETED)
        if not rows:
            return 0
        refused: list[str] = []
        dropped: list[str] = []
        with self._lock:
            if self.overflow == "refuse":
                room = max(0, self.max_records - self._count)
                refused = [r[0] for r in rows[room:]]
                rows = rows[:room]
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                if front:  # explicit keys below the oldest; AUTOINCREMENT only governs the ones it picks
                    first = cur.execute("SELECT COALESCE(MIN(seq), 1) FROM spool").fetchone()[0] - len(rows)
                    cur.executemany("INSERT INTO spool(seq, tenant_id, record_id, value, traceparent, spooled_at) "
                                    "VALUES (?,?,?,?,?,?)", [(first + i, *r) for i, r in enumerate(rows)])
                else:
                    cur.executemany("INSERT INTO spool(tenant_id, record_id, value, traceparent, spooled_at) "
                                    "VALUES (?,?,?,?,?)", rows)
                excess = self._count + len(rows) - self.max_records
                if excess > 0:
                    old = cur.execute("SELECT seq, tenant_id FROM spool ORDER BY seq LIMIT ?", (excess,)).fetchall()
                    cur.executemany("DELETE FROM spool WHERE seq = ?", [(s,) for s, _ in old])
                    dropped = [t for _, t in old]
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            self._count += len(rows) - len(dropped)
            self.counters["appended"] += len(rows)
            self.counters[REASON_OVERFLOW] += len(dropped)
            self.counters[REASON_FULL] += len(refused)
        if self.on_drop:
            for t in dropped:
                self.on_drop(t, REASON_OVERFLOW)
            for t in refused:
                self.on_drop(t, REASON_FULL)
        return len(rows)

    def peek(self, n: int = 100) -> list[SpoolEntry]:
        """The ``n`` oldest records, oldest first (not removed)."""
        with self._lock:
            rows = self._db.execute("SELECT seq, tenant_id, record_id, value, traceparent FROM spool "
                                    "ORDER BY seq LIMIT ?", (n,)).fetchall()
        return [SpoolEntry(s, t, r, bytes(v), tp) for s, t, r, v, tp in rows]

    def ack(self, seqs: Iterable[int]) -> int:
        """Remove records delivered to the broker."""
        seqs = [(s,) for s in seqs]
        if not seqs:
            return 0
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            cur.executemany("DELETE FROM spool WHERE seq = ?", seqs)
            n = cur.rowcount
            cur.execute("COMMIT")
            self._count -= n
            self.counters["replayed"] += n
        return n

    def refuse_before(self, tenant_id: str, cutoff: datetime) -> None:
        """From now on refuse ``tenant_id``'s records created at or before ``cutoff``."""
        with self._lock:
            old = self._refuse.get(tenant_id)
            self._refuse[tenant_id] = max(old, cutoff) if old else cutoff

    def purge_tenant(self, tenant_id: str) -> int:
        """Delete every spooled record of ``tenant_id``; returns how many."""
        with self._lock:
            cur = self._db.execute("DELETE FROM spool WHERE tenant_id = ?", (tenant_id,))
            n = cur.rowcount
            self._count -= n
            self.counters["purged"] += n
            # Move the WAL into the main file (secure_delete zeroes the freed content).
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return n

    def db_mode(self) -> str:
        with self._lock:
            return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    def tenants(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT tenant_id, COUNT(*) FROM spool GROUP BY tenant_id").fetchall())

    def close(self) -> None:
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._db.close()
