"""Kafka plumbing of the learner: the consumer group on the feedback topic and the DLQ.

Offsets are never auto-committed. The service commits an offset only after the
checkpoint covering every record before it is durable (see learner/checkpoint.py). A
learner killed between its checkpoint and its Kafka commit re-reads records it has
already finished with; the checkpoint's de-duplication set (record ids) recognises the
trained ones. No seek to the checkpoint's own offsets: on the embedded broker a restart
resets offsets to 0, and record ids, unlike offsets, stay true.

DLQ messages carry the original key and value and headers ``reason`` (a code from
learner.supervision), ``error`` (the detail), ``source_topic``, ``source_partition``,
``source_offset``, plus the original traceparent. The DLQ is at-least-once: a record
sent there by a step that was then killed is sent again on restart; readers
de-duplicate on (source_partition, source_offset).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

from adaflash.config import KafkaConfig, LearnerConfig
from adaflash.contracts import HEADER_TRACEPARENT

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):
    """Runs on the client's I/O thread: must not block on the consumer."""

    def __init__(self, owner: FeedbackConsumer):
        self.owner = owner

    def on_partitions_revoked(self, revoked):
        parts = {tp.partition for tp in revoked if tp.topic == self.owner.topic}
        if parts:
            self.owner.on_revoked(parts)

    def on_partitions_assigned(self, assigned):
        parts = {tp.partition for tp in assigned if tp.topic == self.owner.topic}
        log.info("assigned partitions %s", sorted(parts))
        if parts and self.owner.on_assigned is not None:
            self.owner.on_assigned(parts)


class FeedbackConsumer:
    def __init__(self, kafka: KafkaConfig, cfg: LearnerConfig, on_revoked: Callable[[set[int]], None],
                 client_id: str = "adaflash-learner", on_assigned: Callable[[set[int]], None] | None = None):
        self.topic = kafka.feedback_topic
        self.dlq_topic = kafka.dlq_topic
        self.on_revoked = on_revoked
        # called inside poll with the partitions just assigned; it may seek them
        self.on_assigned = on_assigned
        self.commit_timeout_ms = kafka.request_timeout_ms * 2
        self.consumer = KafkaConsumer(
            bootstrap_servers=kafka.bootstrap, group_id=kafka.consumer_group, client_id=client_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=cfg.session_timeout_ms, heartbeat_interval_ms=max(500, cfg.session_timeout_ms // 3),
            # A training step holds the poll loop; heartbeats run on their own thread, so the
            # group keeps the learner while it trains. Allow long steps before it is evicted.
            max_poll_interval_ms=1_800_000, max_poll_records=cfg.buffer_size,
            # fresh metadata within seconds, so a topic created again (broker restarted empty) is noticed
            metadata_max_age_ms=cfg.metadata_max_age_ms)
        self.consumer.subscribe([self.topic], listener=_Rebalance(self))
        self._bootstrap, self._client_id = kafka.bootstrap, client_id
        self.producer = self._dlq_producer()
        self._dlq_pending: list[tuple[bytes | None, bytes, list, object]] = []  # (key, value, headers, future)

    def _dlq_producer(self) -> KafkaProducer:
        # Not idempotent (kafka-python 3 turns idempotence on by default): an idempotent
        # producer never recovers from a broker that came back empty (every send fails on
        # InitProducerId), and one request in flight keeps retries in order without it.
        return KafkaProducer(bootstrap_servers=self._bootstrap, acks="all", retries=5, enable_idempotence=False,
                             max_in_flight_requests_per_connection=1, client_id=self._client_id + "-dlq")

    def poll(self, timeout_ms: int) -> list:
        batches = self.consumer.poll(timeout_ms=timeout_ms)
        return [m for tp in sorted(batches, key=lambda t: t.partition) for m in batches[tp]]

    def assigned(self) -> bool:
        return bool(self.consumer.assignment())

    def pause(self) -> None:
        self.consumer.pause(*self.consumer.assignment())

    def resume(self) -> None:
        self.consumer.resume(*self.consumer.paused())

    def to_dlq(self, msg, reason: str, detail: str) -> None:
        headers = [("reason", reason.encode()), ("error", detail[:1000].encode()),
                   ("source_topic", msg.topic.encode()), ("source_partition", str(msg.partition).encode()),
                   ("source_offset", str(msg.offset).encode())]
        headers += [(k, v) for k, v in (msg.headers or []) if k == HEADER_TRACEPARENT]
        self._dlq_pending.append((msg.key, msg.value, headers, self._send_dlq(msg.key, msg.value, headers)))
        log.warning("record at %s/%s -> DLQ (%s: %s)", msg.partition, msg.offset, reason, detail[:200])

    def _send_dlq(self, key, value, headers):
        try:
            return self.producer.send(self.dlq_topic, key=key, value=value, headers=headers)
        except KafkaError as e:  # no metadata while the broker is away: sent again by flush_dlq
            return e

    def flush_dlq(self, timeout_s: float = 30.0, stop: threading.Event | None = None, retry_s: float = 1.0) -> None:
        """Every DLQ message sent so far is acknowledged (acks=all) before offsets move past it.

        A message the broker did not acknowledge (it went away) is sent again until it is;
        raises KafkaError only when ``stop`` is set while waiting."""
        while self._dlq_pending:
            try:
                self.producer.flush(timeout=timeout_s)
            except KafkaError:
                pass
            failed = []
            for key, value, headers, fut in self._dlq_pending:
                try:
                    if isinstance(fut, Exception):
                        raise fut
                    fut.get(timeout=timeout_s)
                except KafkaError as e:
                    failed.append((key, value, headers, e))
            if not failed:
                self._dlq_pending = []
                return
            if stop is not None and stop.is_set():
                raise failed[0][3]
            log.warning("%d DLQ messages not acknowledged (%s); sending them again with a new producer",
                        len(failed), type(failed[0][3]).__name__)
            time.sleep(retry_s)
            self._renew_producer()  # a producer left in a fatal state fails every send after it
            self._dlq_pending = [(k, v, h, self._send_dlq(k, v, h)) for k, v, h, _ in failed]

    def _renew_producer(self) -> None:
        old = self.producer
        try:
            self.producer = self._dlq_producer()
        except KafkaError as e:  # broker still away: keep the old one and try again next round
            log.warning("cannot make a new DLQ producer yet: %s", type(e).__name__)
            return
        with contextlib.suppress(Exception):  # the old one is already broken
            old.close(timeout=0)

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit the group's offsets. A commit refused because a rebalance moved the
        partitions away is logged, not raised: the checkpoint already holds the step."""
        owned = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.topic}
        offsets = {p: o for p, o in offsets.items() if p in owned}
        if not offsets:
            return
        try:
            self.consumer.commit({TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1)
                                  for p, o in offsets.items()}, timeout_ms=self.commit_timeout_ms)
        except CommitFailedError as e:
            log.warning("offset commit refused after a rebalance: %s", e)
        except KafkaError as e:  # broker away: the next checkpoint commits again
            log.warning("offset commit failed (%s); committed with the next checkpoint", type(e).__name__)

    def seek_to_start(self, partitions: set[int] | None = None) -> None:
        """Read the assigned ``partitions`` (default: every one) again from offset 0 (a broker
        that came back empty)."""
        for tp in self.consumer.assignment():
            if tp.topic == self.topic and (partitions is None or tp.partition in partitions):
                self.consumer.seek(tp, 0)

    def close(self) -> None:
        try:
            self.producer.close(timeout=5)
        finally:
            self.consumer.close(autocommit=False, timeout_ms=10_000)
