"""One learner trains each feedback record, across the learner group.

Kafka's committed offsets keep learners off each other's records while the broker keeps its
log. A broker that comes back empty loses the offsets and the group; the nodes' producers
send again what it had acknowledged (governance/producer.py), and the new log's partitions
may go to other learners than before. Each learner de-duplicates against its own ledger,
so a record one learner trained could be trained again by the other. Claims close that:

- before a step, the learner claims the records it is about to train. A record another
  learner reported trained is refused for good (the learner finishes it as
  ``trained_elsewhere``); one another learner holds under a claim younger than ``lease_s``
  is refused for now (the learner keeps it and asks again later);
- after its checkpoint, before it commits offsets, the learner reports the records it
  trained: those claims are final. A claim never reported trained (the learner died
  mid-step) lapses after ``lease_s``, and whoever reads the record again may take it;
- claims older than ``retention_s`` are forgotten (longer than any producer's replay window).

A claim keeps the SHA-256 of the record id, not the id: the table outlives tenant deletions
(a deleted tenant's records are refused by every learner anyway) and holds nothing that
names a record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.models import RecordClaim


@dataclass
class Claimed:
    granted: list[str]
    trained_elsewhere: dict[str, str]  # record id -> the learner that trained it
    held_elsewhere: dict[str, str]  # record id -> the learner whose claim is live


def claim(session: Session, learner_id: str, claim_ids: Iterable[str], trained_ids: Iterable[str], *,
          lease_s: float, retention_s: float, now: datetime | None = None) -> Claimed:
    """Record ``trained_ids`` as trained by ``learner_id``, then claim ``claim_ids`` for it.
    Idempotent for one learner."""
    now = now or utcnow()
    session.execute(delete(RecordClaim).where(RecordClaim.claimed_at < now - timedelta(seconds=retention_s)))
    trained, wanted = list(dict.fromkeys(trained_ids)), list(dict.fromkeys(claim_ids))
    key = {rid: hashlib.sha256(rid.encode()).hexdigest() for rid in trained + wanted}
    found = {r.record_id: r for r in session.scalars(
        select(RecordClaim).where(RecordClaim.record_id.in_(list(set(key.values())))))} if key else {}
    rows = {rid: found[k] for rid, k in key.items() if k in found}
    for rid in trained:
        row = rows.get(rid)
        if row is None:
            rows[rid] = row = RecordClaim(record_id=key[rid], learner_id=learner_id, trained=True, claimed_at=now)
            session.add(row)
        elif row.learner_id == learner_id:
            row.trained = True
        # else trained by another learner too (a lease that lapsed mid-step): the first report stands
    out = Claimed([], {}, {})
    lapsed = now - timedelta(seconds=lease_s)
    for rid in wanted:
        row = rows.get(rid)
        if row is None:
            rows[rid] = RecordClaim(record_id=key[rid], learner_id=learner_id, trained=False, claimed_at=now)
            session.add(rows[rid])
            out.granted.append(rid)
        elif row.learner_id == learner_id:
            if not row.trained:
                row.claimed_at = now
            out.granted.append(rid)
        elif row.trained:
            out.trained_elsewhere[rid] = row.learner_id
        elif row.claimed_at < lapsed:  # the holder never reported it trained
            row.learner_id, row.claimed_at = learner_id, now
            out.granted.append(rid)
        else:
            out.held_elsewhere[rid] = row.learner_id
    session.flush()
    return out
