"""The control plane's audit log: append-only, hash-chained, verifiable.

Every action appends one entry (who, what, when, before, after) in the same
transaction as the change it describes, so a change and its record commit together.
Hashes use ``governance.audit``; the chain's tip lives in ``audit_head``, which every
appender updates first: that serialises appends on SQLite and PostgreSQL alike and
lets verification notice a truncated tail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.models import AuditEntry, AuditHead
from governance.audit import GENESIS, canonical, chain_hash, verify_chain

HEAD_ID = 1
VERIFY_BATCH = 1000


def _jsonable(value: Any) -> Any:
    """What the JSON column will give back, so the hashed body equals the stored one."""
    return None if value is None else json.loads(canonical(value))


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def entry_body(seq: int, at: datetime, actor: str, action: str, target: str, tenant_id: str | None,
               before: Any, after: Any) -> dict[str, Any]:
    """The hashed content of an entry (everything but the two hashes)."""
    return {"seq": seq, "at": _iso(at), "actor": actor, "action": action, "target": target,
            "tenant_id": tenant_id, "before": before, "after": after}


def body_of(entry: AuditEntry) -> dict[str, Any]:
    return entry_body(entry.seq, entry.at, entry.actor, entry.action, entry.target, entry.tenant_id,
                      entry.before, entry.after)


def record(session: Session, *, actor: str, action: str, target: str, tenant_id: str | None = None,
           before: Any = None, after: Any = None, at: datetime | None = None) -> AuditEntry:
    """Append one entry; the caller's commit makes it (and the change it records) durable."""
    # Take the head's lock before reading it: a write lock on SQLite, a row lock on PostgreSQL.
    session.execute(update(AuditHead).where(AuditHead.id == HEAD_ID).values(seq=AuditHead.seq + 1))
    seq, prev_hash = session.execute(
        select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == HEAD_ID)).one()
    at = at or utcnow()
    # Stored timestamps keep microseconds; normalise now so the hash survives the round trip.
    at = at.astimezone(UTC)
    before, after = _jsonable(before), _jsonable(after)
    digest = chain_hash(prev_hash, entry_body(seq, at, actor, action, target, tenant_id, before, after))
    entry = AuditEntry(seq=seq, at=at, actor=actor, action=action, target=target, tenant_id=tenant_id,
                       before=before, after=after, prev_hash=prev_hash, hash=digest)
    session.add(entry)
    session.execute(update(AuditHead).where(AuditHead.id == HEAD_ID).values(hash=digest))
    return entry


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    entries: int
    first_bad_seq: int | None = None
    reason: str = ""


def _all_entries(session: Session) -> Iterator[AuditEntry]:
    after = 0
    while True:
        batch = session.scalars(select(AuditEntry).where(AuditEntry.seq > after)
                                .order_by(AuditEntry.seq).limit(VERIFY_BATCH)).all()
        if not batch:
            return
        yield from batch
        after = batch[-1].seq
        session.expunge_all()  # keep memory flat on long logs


def verify(session: Session) -> VerifyResult:
    """Recompute the whole chain; report the first entry that does not fit.

    Editing, deleting or reordering an entry breaks the chain from that entry on;
    removing entries from the end is caught by comparing with ``audit_head``.
    """
    count, last_seq, last_hash = 0, 0, GENESIS

    def triples() -> Iterator[tuple[dict[str, Any], str, str]]:
        nonlocal count, last_seq, last_hash
        for e in _all_entries(session):
            count, last_seq, last_hash = count + 1, e.seq, e.hash
            yield body_of(e), e.prev_hash, e.hash

    ok, _ = verify_chain(triples())
    if not ok:
        return VerifyResult(False, count, first_bad_seq=last_seq,
                            reason=f"entry {last_seq} does not match the chain")
    head_seq, head_hash = session.execute(
        select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == HEAD_ID)).one()
    if head_seq != last_seq or head_hash != last_hash:
        return VerifyResult(False, count, first_bad_seq=last_seq + 1,
                            reason=f"the chain's head is entry {head_seq} but the log ends at {last_seq}")
    return VerifyResult(True, count)


def list_entries(session: Session, *, after_seq: int = 0, limit: int = 100, action: str | None = None,
                 tenant_ids: list[str] | None = None, target: str | None = None) -> list[AuditEntry]:
    """Entries in order; ``tenant_ids`` limits them to those tenants (an auditor's scope)."""
    q = select(AuditEntry).where(AuditEntry.seq > after_seq)
    if action:
        q = q.where(AuditEntry.action == action)
    if target:
        q = q.where(AuditEntry.target == target)
    if tenant_ids is not None:
        q = q.where(AuditEntry.tenant_id.in_(tenant_ids))
    return list(session.scalars(q.order_by(AuditEntry.seq).limit(limit)))
