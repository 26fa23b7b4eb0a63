"""Prometheus metrics of the control plane (GET /metrics), computed when scraped.

From the database: versions per lifecycle state (candidates waiting, failing gates,
promoted), the age of the oldest candidate awaiting approval and of the newest version
(how long since the learner last published), nodes per status, the learning hold. From Kafka: the
learner's consumer lag (end offset minus the learner group's committed offset, per
partition of the feedback topic), read with a short timeout and cached, so a scrape
never hangs on the broker; ``adaflash_learner_lag_up`` says whether the last read worked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from controlplane import hold
from controlplane.db import utcnow
from controlplane.fleet import is_stale
from controlplane.models import Node, Version
from controlplane.states import VersionState

log = logging.getLogger("adaflash.controlplane")


class ConsumerLag:
    """The learner group's lag on the feedback topic, per partition (records), cached ``cache_s``.

    Kafka is asked in a background thread; a scrape waits at most ``wait_s`` for it and
    otherwise reports the last value (None: unknown), so an unreachable broker (which
    kafka-python retries for tens of seconds) never stalls Prometheus."""

    def __init__(self, bootstrap: str, topic: str, group: str, timeout_ms: int = 3000, cache_s: float = 15.0,
                 wait_s: float = 2.0):
        self.bootstrap, self.topic, self.group = bootstrap, topic, group
        self.timeout_ms, self.cache_s, self.wait_s = timeout_ms, cache_s, wait_s
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: dict[int, int] | None = None
        self._running: threading.Thread | None = None

    def read(self) -> dict[int, int] | None:
        """{partition: records behind}, or None when the broker could not be asked (yet)."""
        with self._lock:
            if self._running is None and time.monotonic() - self._at >= self.cache_s:
                self._running = threading.Thread(target=self._refresh, name="adaflash-lag", daemon=True)
                self._running.start()
            running = self._running
        if running is not None:
            running.join(self.wait_s)
        with self._lock:
            return self._value

    def _refresh(self) -> None:
        value = self._fetch()
        with self._lock:
            self._value, self._at, self._running = value, time.monotonic(), None

    def _fetch(self) -> dict[int, int] | None:
        from kafka import KafkaAdminClient, TopicPartition
        from kafka.admin import OffsetSpec

        try:
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="adaflash-controlplane-lag",
                                     request_timeout_ms=self.timeout_ms)
        except Exception as e:  # no broker: the lag is unknown, not zero
            log.info("consumer lag: broker %s unreachable: %s", self.bootstrap, e)
            return None
        try:
            topics = admin.describe_topics([self.topic])
            parts = [TopicPartition(self.topic, p["partition_index"]) for t in topics for p in t["partitions"]]
            if not parts:
                return None
            ends = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in parts})
            committed = admin.list_group_offsets({self.group: parts}).get(self.group, {})
            out = {}
            for tp in parts:
                done = committed.get(tp)
                start = done.offset if done is not None and done.offset >= 0 else 0
                out[tp.partition] = max(0, ends[tp].offset - start)
            return out
        except Exception as e:
            log.info("consumer lag of group %s unreadable: %s", self.group, e)
            return None
        finally:
            admin.close()


class ControlPlaneCollector(Collector):
    def __init__(self, sessions: sessionmaker, settings: Settings, lag: ConsumerLag | None,
                 now: Callable = utcnow):
        self.sessions, self.settings, self.lag, self.now = sessions, settings, lag, now

    def _database(self, session: Session) -> list[GaugeMetricFamily]:
        now = self.now()
        states = GaugeMetricFamily("adaflash_controlplane_versions", "Drafter versions by lifecycle state",
                                   labels=["state"])
        counts = dict(session.execute(select(Version.state, func.count()).group_by(Version.state)).all())
        for state in VersionState:
            states.add_metric([state.value], counts.get(state.value, 0))
        oldest = session.scalar(select(func.min(Version.state_changed_at))
                                .where(Version.state == VersionState.awaiting_approval.value))
        waiting = GaugeMetricFamily("adaflash_controlplane_awaiting_approval_oldest_seconds",
                                    "Seconds the oldest candidate has waited for approval (0: none waits)")
        waiting.add_metric([], (now - _aware(oldest, now)).total_seconds() if oldest else 0.0)
        newest = session.scalar(select(func.max(Version.created_at)))
        age = GaugeMetricFamily("adaflash_controlplane_newest_version_age_seconds",
                                "Seconds since the newest version was registered (the learner's publishing lag)")
        if newest is not None:
            age.add_metric([], (now - _aware(newest, now)).total_seconds())
        nodes = GaugeMetricFamily("adaflash_controlplane_nodes", "Known serving nodes by status", labels=["status"])
        timeout = self.settings.controlplane.heartbeat_timeout_s
        by: dict[str, int] = {}
        for n in session.scalars(select(Node)):
            key = "stale" if is_stale(n, now, timeout) else n.status
            by[key] = by.get(key, 0) + 1
        for status, count in sorted(by.items()):
            nodes.add_metric([status], count)
        held = GaugeMetricFamily("adaflash_controlplane_hold",
                                 "1 while an admin holds learning or shadow evaluation (controlplane/hold.py)",
                                 labels=["what"])
        h = hold.current(session)
        held.add_metric(["learning"], 1.0 if h.learning else 0.0)
        held.add_metric(["evaluation"], 1.0 if h.evaluation else 0.0)
        return [states, waiting, age, nodes, held]

    def collect(self):
        with self.sessions() as session:
            yield from self._database(session)
        up = GaugeMetricFamily("adaflash_learner_lag_up", "1 if the learner's consumer lag was read from Kafka")
        lag = GaugeMetricFamily("adaflash_learner_lag_records",
                                "Feedback records not yet committed by the learner group, per partition",
                                labels=["partition"])
        value = self.lag.read() if self.lag is not None else None
        up.add_metric([], 1.0 if value is not None else 0.0)
        for partition, behind in sorted((value or {}).items()):
            lag.add_metric([str(partition)], behind)
        yield up
        yield lag


def _aware(dt, like):
    return dt if dt.tzinfo is not None or like.tzinfo is None else dt.replace(tzinfo=like.tzinfo)


def make_registry(sessions: sessionmaker, settings: Settings, lag: ConsumerLag | None = None) -> CollectorRegistry:
    """A registry with the control plane's collector; the learner lag from settings.kafka unless given."""
    if lag is None and settings.controlplane.metrics_kafka_lag:
        k = settings.kafka
        lag = ConsumerLag(k.bootstrap, k.feedback_topic, k.consumer_group,
                          cache_s=settings.controlplane.metrics_lag_cache_s)
    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector(sessions, settings, lag))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
