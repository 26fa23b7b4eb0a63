"""The learner's durable state: weights + optimizer, de-duplication set, offsets, ledger.

Layout under ``state_dir``::

    state.db                  SQLite: meta, seen (record_id de-duplication), offsets,
                              trained (append-only ledger), lineage of unpublished steps
    weights-00000012.pt       drafter + length head state and optimizer state of step 12

A checkpoint is committed in two moves: the weights file is written to a temporary
name, fsynced and renamed into place; then ONE SQLite transaction records the step,
points at that file, adds the step's record ids to ``seen`` and ``trained`` and moves
the per-partition offsets. The transaction is the commit point: a learner killed
before it comes back at the previous step with the previous weights, offsets and
de-duplication set (the orphan file is removed), and one killed after it finds all
four moved together. Kafka offsets are committed only after this, so the group's
committed offsets are a lower bound of the stored ones; whatever the broker delivers
again below them is recognised through ``seen``.

Deletion of a tenant (``purge_tenant``): its record ids in ``seen`` and in the
``trained`` ledger are replaced by ``sha256:<hex of the id>``, so the files no longer
hold them while de-duplication stays exact (``seen`` looks an id up in both forms: a
purged record re-delivered by Kafka is still never trained twice) and the ledger keeps
its length and steps. ``deleted`` keeps the tenant and the request's time: the
learner refuses the tenant's records created up to it (Kafka keeps them until
retention passes). The database uses ``secure_delete`` and is vacuumed and its WAL
truncated after a purge, so the old ids are not left in free pages or the log.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS seen (record_id TEXT PRIMARY KEY, outcome TEXT NOT NULL, step INTEGER NOT NULL,
                                 created_at TEXT);
CREATE TABLE IF NOT EXISTS trained (record_id TEXT NOT NULL, tenant_id TEXT NOT NULL, step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL,
                                    PRIMARY KEY (topic, partition));
CREATE TABLE IF NOT EXISTS deleted (tenant_id TEXT PRIMARY KEY, before TEXT NOT NULL);
"""
HASHED = "sha256:"


def hashed_id(record_id: str) -> str:
    """The form a purged record id is kept in (de-duplication without the id itself)."""
    return HASHED + hashlib.sha256(record_id.encode()).hexdigest()


@dataclass
class Done:
    """A record a step is finished with: trained on, or dropped (expired, opted out)."""

    record_id: str
    tenant_id: str
    outcome: str  # "trained" | "expired" | "opt_out"
    created_at: str = ""


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    def __init__(self, state_dir: str | Path, keep: int = 2):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self.db = sqlite3.connect(self.dir / "state.db", isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.executescript(SCHEMA)
        if "tenant_id" not in {r[1] for r in self.db.execute("PRAGMA table_info(seen)")}:
            self.db.execute("ALTER TABLE seen ADD COLUMN tenant_id TEXT")  # stores from before deletions
        self._remove_orphans()

    def close(self) -> None:
        self.db.close()

    # --- reading ----------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @property
    def step(self) -> int:
        return int(self.meta("step", 0))

    def weights_path(self) -> Path | None:
        name = self.meta("weights")
        return self.dir / name if name else None

    def offsets(self, topic: str) -> dict[int, int]:
        rows = self.db.execute("SELECT partition, next_offset FROM offsets WHERE topic = ?", (topic,))
        return {int(p): int(o) for p, o in rows}

    def seen(self, record_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM seen WHERE record_id IN (?, ?)",
                               (record_id, hashed_id(record_id))).fetchone() is not None

    def ledger(self) -> list[tuple[str, int]]:
        """(record_id, step) for every record trained on, in order (append-only)."""
        return [(r, int(s)) for r, s in self.db.execute("SELECT record_id, step FROM trained ORDER BY rowid")]

    def load_into(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Restore the last committed weights (and optimizer); False if there is none yet."""
        p = self.weights_path()
        if p is None:
            return False
        state = torch.load(p, map_location="cpu", weights_only=True)
        module.load_state_dict(state["model"])
        if optimizer is not None and state.get("optimizer"):
            optimizer.load_state_dict(state["optimizer"])
        return True

    # --- the commit ------------------------------------------------------------------------------
    def write_weights(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
        """First half of a checkpoint: the weights file, durable under its final name."""
        name = f"weights-{step:08d}.pt"
        tmp = self.dir / f".{name}.tmp"
        state = {"model": {k: v.detach().cpu() for k, v in module.state_dict().items()},
                 "optimizer": optimizer.state_dict() if optimizer is not None else None}
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        _fsync_dir(self.dir)
        return name

    def commit(self, step: int, weights: str, done: Iterable[Done], topic: str, offsets: dict[int, int],
               meta: dict | None = None) -> None:
        """Second half: one transaction moves step, weights, seen, ledger and offsets together."""
        done = list(done)
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.executemany("INSERT OR IGNORE INTO seen (record_id, outcome, step, created_at, tenant_id) "
                            "VALUES (?, ?, ?, ?, ?)",
                            [(d.record_id, d.outcome, step, d.created_at, d.tenant_id) for d in done])
            cur.executemany("INSERT INTO trained VALUES (?, ?, ?)",
                            [(d.record_id, d.tenant_id, step) for d in done if d.outcome == "trained"])
            cur.executemany("INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, partition) "
                            "DO UPDATE SET next_offset = excluded.next_offset",
                            [(topic, int(p), int(o)) for p, o in offsets.items()])
            for key, value in {"step": step, "weights": weights, **(meta or {})}.items():
                cur.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                            (key, json.dumps(value, default=str)))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        self._prune(step)

    def set_meta(self, values: dict) -> None:
        with self.db:
            for key, value in values.items():
                self.db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                                (key, json.dumps(value, default=str)))

    # --- deletion --------------------------------------------------------------------------------
    def deleted_before(self) -> dict[str, datetime]:
        """Tenant -> time of its deletion request: its records created up to it are refused."""
        return {t: datetime.fromisoformat(b) for t, b in self.db.execute("SELECT tenant_id, before FROM deleted")}

    def purge_tenant(self, tenant_id: str, before: datetime) -> dict[str, int]:
        """Replace the tenant's record ids by their hashes (ledger and de-duplication set),
        remember the deletion; returns {"ledger": n, "seen": n} (ids replaced now)."""
        before = before if before.tzinfo else before.replace(tzinfo=UTC)
        old = self.deleted_before().get(tenant_id)
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.execute("INSERT INTO deleted VALUES (?, ?) ON CONFLICT (tenant_id) DO UPDATE SET before = "
                        "excluded.before", (tenant_id, max(old, before).isoformat() if old else before.isoformat()))
            trained = [r for (r,) in cur.execute("SELECT DISTINCT record_id FROM trained WHERE tenant_id = ? AND "
                                                 "record_id NOT LIKE 'sha256:%'", (tenant_id,))]
            cur.executemany("UPDATE trained SET record_id = ? WHERE record_id = ?",
                            [(hashed_id(r), r) for r in trained])
            ids = set(trained) | {r for (r,) in cur.execute(
                "SELECT record_id FROM seen WHERE tenant_id = ? AND record_id NOT LIKE 'sha256:%'", (tenant_id,))}
            n_seen = 0
            for r in ids:
                n_seen += cur.execute("UPDATE seen SET record_id = ? WHERE record_id = ?", (hashed_id(r), r)).rowcount
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        # Nothing of the old ids left in free pages (secure_delete), the rebuilt file or the WAL.
        self.db.execute("VACUUM")
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return {"ledger": len(trained), "seen": n_seen}

    # --- housekeeping ----------------------------------------------------------------------------
    def _files(self) -> list[Path]:
        return sorted(self.dir.glob("weights-*.pt"))

    def _remove_orphans(self) -> None:
        """Weights written by a step whose transaction never committed, and stray temp files."""
        current = self.weights_path()
        for p in self.dir.glob(".weights-*.tmp"):
            p.unlink(missing_ok=True)
        for p in self._files():
            if current is None or p.name > current.name:
                p.unlink(missing_ok=True)

    def _prune(self, step: int) -> None:
        files = self._files()
        for p in files[:-self.keep]:
            p.unlink(missing_ok=True)
