"""Retention (TTL) and deletion.

TTL: a record may be used (replay buffer, evaluation windows) only while
``created_at + policy.ttl_days`` lies in the future. The feedback topic keeps records
for the longest TTL of any tenant; consumers apply each tenant's own TTL on read.

Deletion: every store the platform owns implements ``Purgeable.purge_tenant``. The
spool, the usage audit's samples and the emitter's queue do here; the learner's replay
buffer and the control plane's evaluation windows register theirs. What cannot be
purged at once is reported with the time it will be gone: records already written to
Kafka stay until topic retention has passed (Kafka deletes whole segments, so at most
retention.ms + segment.ms after the last record was written).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

from adaflash.contracts.feedback import FeedbackRecord
from adaflash.contracts.tenancy import TenantPolicy

log = logging.getLogger(__name__)

MS_PER_DAY = 86_400_000


def _now(now: datetime | None) -> datetime:
    now = now or datetime.now(UTC)
    return now if now.tzinfo else now.replace(tzinfo=UTC)


def expires_at(record: FeedbackRecord, policy: TenantPolicy) -> datetime:
    return record.created_at + timedelta(days=policy.ttl_days)


def is_expired(record: FeedbackRecord, policy: TenantPolicy, now: datetime | None = None) -> bool:
    """True once the record is past its tenant's TTL (it must not be used any more)."""
    return expires_at(record, policy) <= _now(now)


def topic_retention_ms(policies: Iterable[TenantPolicy], default_ttl_days: float = 30.0) -> int:
    """``retention.ms`` for the feedback topic: the longest TTL of any tenant (and the default)."""
    days = max([default_ttl_days, *(p.ttl_days for p in policies)])
    return int(days * MS_PER_DAY)


@runtime_checkable
class Purgeable(Protocol):
    """A store holding tenant records; ``purge_tenant`` deletes them all, returns how many."""

    name: str

    def purge_tenant(self, tenant_id: str) -> int: ...


@dataclass
class PendingPurge:
    store: str
    reason: str
    gone_by: datetime


@dataclass
class PurgeReport:
    tenant_id: str
    requested_at: datetime
    purged: dict[str, int] = field(default_factory=dict)  # store -> records deleted now
    failed: dict[str, str] = field(default_factory=dict)  # store -> error type (retry needed)
    pending: list[PendingPurge] = field(default_factory=list)

    @property
    def complete_now(self) -> bool:
        return not self.failed and not self.pending

    @property
    def complete_by(self) -> datetime:
        return max([self.requested_at, *(p.gone_by for p in self.pending)])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["requested_at"] = self.requested_at.isoformat()
        d["complete_by"] = self.complete_by.isoformat()
        d["pending"] = [{**asdict(p), "gone_by": p.gone_by.isoformat()} for p in self.pending]
        return d


def kafka_gone_by(retention_ms: int, segment_ms: int = 0, last_write: datetime | None = None,
                  now: datetime | None = None) -> datetime:
    """When the last record written at ``last_write`` (default now) is deleted by Kafka."""
    base = _now(last_write) if last_write else _now(now)
    return base + timedelta(milliseconds=retention_ms + max(0, segment_ms))


def purge_tenant(tenant_id: str, stores: Iterable[Purgeable], *, retention_ms: int | None = None,
                 segment_ms: int = 0, topics: Iterable[str] = (), last_write: datetime | None = None,
                 now: datetime | None = None) -> PurgeReport:
    """Purge ``tenant_id`` from every store; report what only time will purge.

    ``topics`` with ``retention_ms``: the Kafka topics that may hold the tenant's records
    (Kafka cannot delete single records of a delete-policy topic).
    """
    report = PurgeReport(tenant_id=tenant_id, requested_at=_now(now))
    for store in stores:
        name = getattr(store, "name", type(store).__name__)
        try:
            report.purged[name] = report.purged.get(name, 0) + int(store.purge_tenant(tenant_id))
        except Exception as e:  # noqa: BLE001 - report, let the caller retry
            log.error("purge of %s failed: %s", name, type(e).__name__)
            report.failed[name] = type(e).__name__
    if retention_ms is not None:
        gone = kafka_gone_by(retention_ms, segment_ms, last_write, now)
        for t in topics:
            report.pending.append(PendingPurge(store=f"kafka:{t}", reason="records stay until topic retention passes",
                                               gone_by=gone))
    return report
