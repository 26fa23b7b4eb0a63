"""Per-tenant, per-day feedback accounting and on-request scrubbed samples.

Table ``usage(tenant_id, day, kind, name, count)`` where kind is ``emitted`` (name ""),
``dropped`` (name = reason) or ``entity`` (name = PII entity type). Counts only: no text.
Samples: when an auditor asks for a tenant's samples (``request_samples``), the next
``n`` scrubbed records of that tenant are kept (newest ``n`` retained) for review.
Samples hold scrubbed text only and are purged with the tenant.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping
from datetime import UTC, date, datetime
from pathlib import Path

from governance.pii import ScrubbedRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant_id TEXT NOT NULL, day TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day, kind, name)
);
CREATE TABLE IF NOT EXISTS sample_requests (
    tenant_id TEXT PRIMARY KEY, keep INTEGER NOT NULL, requested_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS samples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant_id TEXT NOT NULL, record_id TEXT NOT NULL,
    created_at TEXT NOT NULL, value TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_tenant ON samples(tenant_id, seq);
"""


def _day(when: datetime | date | None) -> str:
    if when is None:
        when = datetime.now(UTC)
    if isinstance(when, datetime):
        when = when.astimezone(UTC).date()
    return when.isoformat()


class UsageAudit:
    """SQLite store of per tenant/day counts and sample records. Thread-safe."""

    name = "usage_audit"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA secure_delete=ON")
        self._db.executescript(_SCHEMA)
        self._sampling: dict[str, int] = dict(self._db.execute("SELECT tenant_id, keep FROM sample_requests"))

    def _add(self, rows: list[tuple[str, str, str, str, int]]) -> None:
        with self._lock:
            self._db.executemany(
                "INSERT INTO usage(tenant_id, day, kind, name, count) VALUES (?,?,?,?,?) "
                "ON CONFLICT(tenant_id, day, kind, name) DO UPDATE SET count = count + excluded.count", rows)

    def record_emitted(self, tenant_id: str, pii: Mapping[str, int] | None = None,
                       when: datetime | None = None) -> None:
        d = _day(when)
        rows = [(tenant_id, d, "emitted", "", 1)]
        rows += [(tenant_id, d, "entity", k, int(v)) for k, v in (pii or {}).items() if v]
        self._add(rows)

    def record_dropped(self, tenant_id: str, reason: str, when: datetime | None = None, n: int = 1) -> None:
        self._add([(tenant_id, _day(when), "dropped", reason, n)])

    def report(self, tenant_id: str | None = None, since: date | None = None,
               until: date | None = None) -> list[dict]:
        """``[{tenant_id, day, emitted, dropped: {reason: n}, entities: {type: n}}]`` by tenant, day."""
        q = "SELECT tenant_id, day, kind, name, count FROM usage WHERE 1=1"
        args: list = []
        if tenant_id is not None:
            q += " AND tenant_id = ?"
            args.append(tenant_id)
        if since is not None:
            q += " AND day >= ?"
            args.append(_day(since))
        if until is not None:
            q += " AND day <= ?"
            args.append(_day(until))
        with self._lock:
            rows = self._db.execute(q + " ORDER BY tenant_id, day", args).fetchall()
        out: dict[tuple[str, str], dict] = {}
        for t, d, kind, name, n in rows:
            e = out.setdefault((t, d), {"tenant_id": t, "day": d, "emitted": 0, "dropped": {}, "entities": {}})
            if kind == "emitted":
                e["emitted"] += n
            elif kind == "dropped":
                e["dropped"][name] = e["dropped"].get(name, 0) + n
            else:
                e["entities"][name] = e["entities"].get(name, 0) + n
        return list(out.values())

    # -- samples --------------------------------------------------------------------------
    def request_samples(self, tenant_id: str, keep: int = 5) -> None:
        """Start keeping the newest ``keep`` scrubbed records of ``tenant_id`` (0 stops)."""
        with self._lock:
            if keep <= 0:
                self._db.execute("DELETE FROM sample_requests WHERE tenant_id = ?", (tenant_id,))
                self._sampling.pop(tenant_id, None)
            else:
                self._db.execute("INSERT OR REPLACE INTO sample_requests VALUES (?,?,?)",
                                 (tenant_id, keep, datetime.now(UTC).isoformat()))
                self._sampling[tenant_id] = keep

    def wants_sample(self, tenant_id: str) -> bool:
        return tenant_id in self._sampling

    def add_sample(self, record: ScrubbedRecord) -> bool:
        if not isinstance(record, ScrubbedRecord):
            raise TypeError("samples hold scrubbed records only (governance.pii.ScrubbedRecord)")
        keep = self._sampling.get(record.tenant_id)
        if not keep:
            return False
        r = record.record
        with self._lock:
            self._db.execute("INSERT INTO samples(tenant_id, record_id, created_at, value) VALUES (?,?,?,?)",
                             (r.tenant_id, r.record_id, r.created_at.isoformat(), r.model_dump_json()))
            self._db.execute("DELETE FROM samples WHERE tenant_id = ? AND seq NOT IN "
                             "(SELECT seq FROM samples WHERE tenant_id = ? ORDER BY seq DESC LIMIT ?)",
                             (r.tenant_id, r.tenant_id, keep))
        return True

    def samples(self, tenant_id: str) -> list[dict]:
        import json

        with self._lock:
            rows = self._db.execute("SELECT value FROM samples WHERE tenant_id = ? ORDER BY seq",
                                    (tenant_id,)).fetchall()
        return [json.loads(v) for (v,) in rows]

    def purge_tenant(self, tenant_id: str) -> int:
        """Delete the tenant's sample records (counts carry no content and stay for audit)."""
        with self._lock:
            n = self._db.execute("DELETE FROM samples WHERE tenant_id = ?", (tenant_id,)).rowcount
            self._db.execute("DELETE FROM sample_requests WHERE tenant_id = ?", (tenant_id,))
            self._sampling.pop(tenant_id, None)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return n

    def close(self) -> None:
        with self._lock:
            self._db.close()
