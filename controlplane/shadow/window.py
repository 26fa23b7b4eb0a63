"""Where shadow evaluation reads feedback from, and which records it may use.

Feedback comes from a ``FeedbackWindow`` (the Kafka feedback topic read from its tail,
or a JSONL file / list for tests and offline runs). Only records reserved for evaluation
are used (``adaflash.contracts.feedback.is_evaluation_record``: the learner never trains
on them), inside their tenant's feedback TTL, from tenants that have not opted out, for
this target; the newest ``max_records`` are kept.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from adaflash.config import Settings
from adaflash.contracts.feedback import FeedbackRecord, InvalidRecord, is_evaluation_record

log = logging.getLogger("adaflash.controlplane.shadow")


class FeedbackWindow(Protocol):
    """Where recent feedback records come from (unfiltered: ``select_window`` filters)."""

    def read(self) -> Iterable[FeedbackRecord]: ...


class RecordsWindow:
    """Records from a list, or from a JSONL file of FeedbackRecord JSON (one per line)."""

    def __init__(self, records: Iterable[FeedbackRecord | Mapping] | None = None, path: str | Path | None = None):
        self._records = list(records or [])
        self.path = Path(path) if path else None

    def read(self) -> Iterator[FeedbackRecord]:
        for r in self._records:
            yield r if isinstance(r, FeedbackRecord) else FeedbackRecord.model_validate(r)
        if self.path is not None and self.path.is_file():
            with self.path.open() as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield FeedbackRecord.from_bytes(line)
                        except InvalidRecord as e:
                            log.warning("%s:%d skipped: %s", self.path, n, e)


class KafkaFeedbackWindow:
    """The last ``per_partition`` records of every partition of the feedback topic.

    A plain consumer without a group (nothing committed, no rebalance): it seeks each
    partition to end - per_partition and reads up to the end offsets it saw first.
    """

    def __init__(self, bootstrap: str, topic: str, per_partition: int = 500, timeout_s: float = 20.0):
        self.bootstrap, self.topic = bootstrap, topic
        self.per_partition, self.timeout_s = per_partition, timeout_s
        self.invalid = 0

    def read(self) -> list[FeedbackRecord]:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                 request_timeout_ms=int(self.timeout_s * 1000) + 5000)
        try:
            parts = consumer.partitions_for_topic(self.topic) or set()
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            if not tps:
                return []
            consumer.assign(tps)
            ends = consumer.end_offsets(tps)
            begins = consumer.beginning_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(begins.get(tp) or 0, (ends.get(tp) or 0) - self.per_partition))
            # Keep the last per_partition records of each partition. Read until every position
            # passed its end offset and a poll comes back empty: a broker that under-reports its
            # end offsets (the embedded Tansu does) is then read to its real end.
            tails = {tp: deque(maxlen=self.per_partition) for tp in tps}
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                batch = consumer.poll(timeout_ms=500, max_records=2000)
                for tp, msgs in batch.items():
                    tails[tp].extend(m.value for m in msgs)
                if not batch and all(consumer.position(tp) >= (ends.get(tp) or 0) for tp in tps):
                    break
            else:
                log.warning("feedback window read stopped after %.0f s", self.timeout_s)
            out: list[FeedbackRecord] = []
            for tp in tps:
                for raw in tails[tp]:
                    try:
                        out.append(FeedbackRecord.from_bytes(raw))
                    except InvalidRecord:
                        self.invalid += 1
            return out
        finally:
            consumer.close()


def window_from_settings(settings: Settings) -> FeedbackWindow:
    cp = settings.controlplane
    if cp.feedback_source == "jsonl":
        return RecordsWindow(path=cp.feedback_jsonl)
    if cp.feedback_source == "none":
        return RecordsWindow()
    return KafkaFeedbackWindow(settings.kafka.bootstrap, settings.kafka.feedback_topic,
                               per_partition=cp.shadow_per_partition)


def select_window(records: Iterable[FeedbackRecord], *, now: datetime, target_id: str | None,
                  tenant_ttl_days: Mapping[str, float], default_ttl_days: float, opted_out: Iterable[str] = (),
                  max_records: int = 2000, deleted_before: Mapping[str, datetime] | None = None
                  ) -> list[FeedbackRecord]:
    """Held-out records inside their tenant's TTL, newest ``max_records`` first, deduplicated.

    deleted_before: tenant -> time of its deletion request; records created up to it are
    refused (Kafka keeps them until retention passes, the platform must not use them).
    """
    opted = set(opted_out)
    deleted = dict(deleted_before or {})
    seen: dict[str, FeedbackRecord] = {}
    for r in records:
        if r.record_id in seen or not is_evaluation_record(r.record_id) or r.tenant_id in opted:
            continue
        if r.tenant_id in deleted and r.created_at <= deleted[r.tenant_id]:
            continue
        if target_id is not None and r.target_model.id != target_id:
            continue
        ttl = tenant_ttl_days.get(r.tenant_id, default_ttl_days)
        if r.created_at < now - timedelta(days=ttl) or r.created_at > now + timedelta(minutes=5):
            continue
        seen[r.record_id] = r
    newest = sorted(seen.values(), key=lambda r: r.created_at, reverse=True)[:max_records]
    return sorted(newest, key=lambda r: r.created_at)
