"""The control plane's own copy of its shadow-evaluation window.

The feedback topic is where evaluation records come from, but it is not a store the
control plane can lean on: the embedded broker keeps it in memory (a restart empties
it) and Kafka's retention is per topic, not per tenant. So every held-out record the
control plane reads for evaluation is also written to its database
(``eval_window_records``), and the window shadow evaluation replays is that table:
what the source still has plus what it has lost since.

Retention and deletion are honoured here too: a row expires at its record's created_at
plus its tenant's ``ttl_days`` (pruned at each read); an opted-out tenant's records and
records of a tenant created up to its deletion request are never stored; a tenant
deletion request removes the tenant's rows (``purge_tenant``, called by
controlplane.deletion). At most ``controlplane.eval_window_max_records`` rows are kept,
the newest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from adaflash.contracts.feedback import FeedbackRecord, InvalidRecord, is_evaluation_record
from controlplane.db import session_scope, utcnow
from controlplane.models import ID_LEN, EvalWindowRecord, Tenant

log = logging.getLogger("adaflash.controlplane.eval_window")


class PersistentWindow:
    """A FeedbackWindow: reads ``source``, keeps what it read, returns everything it keeps."""

    def __init__(self, source, sessions: sessionmaker[Session], settings: Settings):
        self.source, self.sessions, self.settings = source, sessions, settings
        self.source_errors = 0

    def read(self) -> list[FeedbackRecord]:
        try:
            fresh = list(self.source.read())
        except Exception as e:  # noqa: BLE001 - broker away: the stored window still serves
            self.source_errors += 1
            log.warning("feedback source unavailable (%s); evaluating on the stored window", type(e).__name__)
            fresh = []
        now = utcnow()
        with session_scope(self.sessions) as s:
            stored = store(s, fresh, self.settings, now=now)
            prune(s, now=now, max_records=self.settings.controlplane.eval_window_max_records)
            out = load(s)
        log.info("evaluation window: %d read from the source, %d newly stored, %d kept", len(fresh), stored, len(out))
        return out


def store(session: Session, records: Iterable[FeedbackRecord], settings: Settings, *, now: datetime) -> int:
    """Insert held-out records not stored yet; returns how many were added."""
    from controlplane.deletion import deleted_before

    tenants = {t.tenant_id: t for t in session.scalars(select(Tenant))}
    cutoffs = deleted_before(session)
    default_ttl = settings.governance.default_ttl_days
    fresh: dict[str, FeedbackRecord] = {}
    for r in records:
        t = tenants.get(r.tenant_id)
        cut = cutoffs.get(r.tenant_id)
        if not is_evaluation_record(r.record_id) or (t is not None and t.opt_out):
            continue
        if len(r.record_id) > ID_LEN or len(r.target_model.id) > ID_LEN:
            continue  # not a record this platform's nodes write
        if cut is not None and r.created_at <= cut:
            continue
        expires = r.created_at + timedelta(days=t.ttl_days if t is not None else default_ttl)
        if expires > now:
            fresh[r.record_id] = r
    if not fresh:
        return 0
    have = set(session.scalars(select(EvalWindowRecord.record_id)
                               .where(EvalWindowRecord.record_id.in_(list(fresh)))))
    added = 0
    for rid, r in fresh.items():
        if rid in have:
            continue
        t = tenants.get(r.tenant_id)
        session.add(EvalWindowRecord(
            record_id=rid, tenant_id=r.tenant_id, target_id=r.target_model.id, created_at=r.created_at,
            expires_at=r.created_at + timedelta(days=t.ttl_days if t is not None else default_ttl),
            stored_at=now, body=r.model_dump_json()))
        added += 1
    session.flush()
    return added


def prune(session: Session, *, now: datetime, max_records: int) -> int:
    """Drop expired rows, then all but the newest ``max_records``; returns rows removed."""
    n = session.execute(delete(EvalWindowRecord).where(EvalWindowRecord.expires_at <= now)).rowcount or 0
    total = session.scalar(select(func.count()).select_from(EvalWindowRecord)) or 0
    if total > max_records:
        cut = session.scalar(select(EvalWindowRecord.created_at).order_by(EvalWindowRecord.created_at.desc())
                             .offset(max_records).limit(1))
        if cut is not None:
            n += session.execute(delete(EvalWindowRecord).where(EvalWindowRecord.created_at <= cut)).rowcount or 0
    return n


def load(session: Session) -> list[FeedbackRecord]:
    out = []
    for body in session.scalars(select(EvalWindowRecord.body).order_by(EvalWindowRecord.created_at)):
        try:
            out.append(FeedbackRecord.from_bytes(body))
        except InvalidRecord as e:  # a schema the code no longer reads: skipped, pruned by TTL
            log.warning("stored evaluation record skipped: %s", e)
    return out


def purge_tenant(session: Session, tenant_id: str) -> int:
    """A tenant deletion: every stored record of the tenant goes."""
    return session.execute(delete(EvalWindowRecord).where(EvalWindowRecord.tenant_id == tenant_id)).rowcount or 0


def persisted(window, sessions: sessionmaker[Session], settings: Settings):
    """The window shadow evaluation reads: the Kafka source with the database copy in front of
    it (``controlplane.eval_window_persist``); a JSONL file or no source is its own store."""
    if not settings.controlplane.eval_window_persist or settings.controlplane.feedback_source != "kafka":
        return window
    return PersistentWindow(window, sessions, settings)
