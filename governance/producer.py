"""Kafka producer for scrubbed feedback, with a durable spool for broker outages.

Per DESIGN.md: topic ``adaflash.feedback.v1``, key = tenant id (a tenant's records
share a partition), value = FeedbackRecord JSON, headers ``schema_version`` and
``traceparent``, acks=all, retries.

Idempotence: off by default (``kafka.idempotence``). kafka-python's idempotent producer
never recovers after the embedded broker (Tansu) restarts: every send then fails on
InitProducerId. What idempotence buys (no duplicates from retries, order under several
requests in flight) is had here by other means: acks=all, one request in flight per
connection (retries cannot reorder), and ``record_id`` de-duplication in the consumer,
which is needed anyway because a record can be sent twice when an acknowledgement is
lost during an outage and the record is replayed from the spool. When turned on (e.g.
against Apache Kafka), the sender still replaces the producer object after any failed
batch, which is what a broken idempotent producer needs.

Ordering: one sender thread owns the Kafka producer and the spool. It always empties
the spool (oldest first) before taking new records, and when a batch fails, the failed
records and every record behind them go to the spool in order. So a tenant's records
reach the broker in the order they were handed to ``send`` (bar records whose
acknowledgement was lost, which are then delivered twice).

A broker that comes back empty (Tansu's memory storage; a cluster rebuilt) forgets what it
had acknowledged, and what no consumer had read by then is lost unless someone sends it
again. The producer keeps the records acknowledged within ``kafka.replay_window_s`` (at
most ``replay_window_records``, in memory) with the topic's id at the time, watches that
id in its cluster metadata (a topic created again gets a new id; looked at after every
batch and every ``RESET_CHECK_S`` while records are kept), and on a change puts the kept
records of the old topic back at the front of the spool, in their order, to be sent again
before anything newer. Consumers see some of them twice and de-duplicate by ``record_id``,
as for any replay. Records acknowledged before the node itself restarted are not kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adaflash.config import KafkaConfig
from adaflash.contracts import FEEDBACK_SCHEMA_VERSION, HEADER_SCHEMA_VERSION, HEADER_TRACEPARENT
from adaflash.contracts.feedback import FeedbackRecord
from governance.pii import ScrubbedRecord
from governance.spool import Spool, SpoolEntry

log = logging.getLogger(__name__)

REASON_BACKLOG = "producer_backlog"
RESET_CHECK_S = 2.0  # how often the topic's id is looked at while acknowledged records are kept


@dataclass(frozen=True)
class _Acked:
    """A record the broker acknowledged, kept for a replay should the broker lose it."""
    at: float  # time.monotonic() of the acknowledgement
    tenant_id: str
    topic_id: object  # the topic's id when it was acknowledged (None: not known yet)
    value: bytes
    traceparent: str | None


@dataclass
class _Item:
    tenant_id: str
    record_id: str
    value: bytes
    traceparent: str | None
    scrubbed: ScrubbedRecord | None = None  # kept so a failed item can be spooled


def _headers(traceparent: str | None) -> list[tuple[str, bytes]]:
    h = [(HEADER_SCHEMA_VERSION, str(FEEDBACK_SCHEMA_VERSION).encode())]
    if traceparent:
        h.append((HEADER_TRACEPARENT, traceparent.encode()))
    return h


class FeedbackProducer:
    """Sends scrubbed records to Kafka; spools them while the broker is unreachable.

    ``send`` never talks to the network: it hands the record to the sender thread
    (bounded queue; waits at most ``put_timeout_s`` when full, then returns False).
    """

    def __init__(self, bootstrap: str, spool: Spool, kafka: KafkaConfig | None = None, *,
                 retention_ms: int | None = None,
                 ensure_topics_fn: Callable[[], object] | None = None,
                 producer_factory: Callable[[], object] | None = None,
                 queue_size: int = 10_000, batch_size: int = 200,
                 backoff_s: tuple[float, float] = (0.2, 5.0), put_timeout_s: float = 0.5,
                 start: bool = True):
        self.bootstrap = bootstrap
        self.kafka = kafka or KafkaConfig(bootstrap=bootstrap)
        self.topic = self.kafka.feedback_topic
        self.spool = spool
        self.batch_size = batch_size
        self.backoff_min, self.backoff_max = backoff_s
        self.put_timeout_s = put_timeout_s
        if ensure_topics_fn is None and self.kafka.ensure_topics:
            from adaflash.contracts.topics import default_retention_ms, ensure_topics

            ret = retention_ms or default_retention_ms()
            ensure_topics_fn = lambda: ensure_topics(bootstrap, self.kafka, ret,  # noqa: E731
                                                     timeout_ms=self.kafka.request_timeout_ms)
        self._ensure_topics = ensure_topics_fn
        # With topic management on (embedded broker), check before each batch that the
        # topic still exists. Tansu's memory storage forgets topics on restart, and a
        # producer that reconnects on its own then makes Tansu auto-create the topic in a
        # state consumers cannot read; so a missing topic means: drop this producer,
        # recreate the topics, then connect a new one.
        self._check_topics = ensure_topics_fn is not None
        self._admin = None
        self._factory = producer_factory or self._default_factory
        self._q: queue.Queue[_Item] = queue.Queue(maxsize=queue_size)
        self._kp = None
        self._outstanding = 0  # handed to send(), not yet delivered or spooled
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {"sent": 0, "replayed": 0, "spooled": 0, "failed_batches": 0,
                                         "connects": 0, "connect_failures": 0, REASON_BACKLOG: 0,
                                         "broker_resets": 0, "resent_after_reset": 0}
        self._acked: deque[_Acked] = deque(maxlen=max(1, self.kafka.replay_window_records))
        self._topic_id = None  # the feedback topic's id as last seen in the cluster metadata
        self._last_reset_check = 0.0
        self._thread = threading.Thread(target=self._run, name="feedback-producer", daemon=True)
        if start:
            self._thread.start()

    # -- public ------------------------------------------------------------------------
    def send(self, record: ScrubbedRecord, traceparent: str | None = None) -> bool:
        if not isinstance(record, ScrubbedRecord):
            raise TypeError("the producer sends scrubbed records only (governance.pii.ScrubbedRecord)")
        if self._stop.is_set():
            return False
        item = _Item(record.tenant_id, record.record_id, record.record.to_bytes(), traceparent, record)
        with self._lock:
            self._outstanding += 1
        try:
            self._q.put(item, timeout=self.put_timeout_s)
        except queue.Full:
            self._resolved(1)
            self.counters[REASON_BACKLOG] += 1
            return False
        return True

    def _resolved(self, n: int) -> None:
        with self._lock:
            self._outstanding -= n

    @property
    def connected(self) -> bool:
        return self._kp is not None

    def pending(self) -> int:
        """Records not yet acknowledged by the broker (queued, in flight or spooled)."""
        return self._outstanding + len(self.spool)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every record handed to ``send`` is in Kafka; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pending() == 0:
                return True
            time.sleep(0.05)
        return self.pending() == 0

    name = "producer_queue"

    def purge_tenant(self, tenant_id: str) -> int:
        """Drop the tenant's records still waiting for the sender thread; returns how many.

        A batch the sender already holds goes to the broker (then Kafka retention
        removes it) or, failing, to the spool, which refuses records of a deleted tenant
        (``Spool.refuse_before``)."""
        with self._q.mutex:
            keep = [it for it in self._q.queue if not (isinstance(it, _Item) and it.tenant_id == tenant_id)]
            n = len(self._q.queue) - len(keep)
            self._q.queue.clear()
            self._q.queue.extend(keep)
            self._q.not_full.notify_all()
        if n:
            self._resolved(n)
        with self._lock:  # and what a broker reset would send again
            self._acked = deque((a for a in self._acked if a.tenant_id != tenant_id), maxlen=self._acked.maxlen)
        return n

    def stats(self) -> dict[str, int | bool]:
        return {**self.counters, "queued": self._q.qsize(), "spool_depth": len(self.spool),
                "connected": self.connected}

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what can be delivered within ``timeout``; spool the rest (durable)."""
        self.flush(timeout)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, self.kafka.delivery_timeout_ms / 1000 + 2))
        self._spill_queue()
        self._disconnect()

    # -- sender thread -------------------------------------------------------------------
    def _default_factory(self):
        from kafka import KafkaProducer

        k = self.kafka
        return KafkaProducer(
            bootstrap_servers=self.bootstrap, client_id="adaflash-feedback",
            acks="all", retries=2**31 - 1, enable_idempotence=k.idempotence,
            max_in_flight_requests_per_connection=1 if not k.idempotence else 5,
            linger_ms=5, request_timeout_ms=k.request_timeout_ms,
            delivery_timeout_ms=max(k.delivery_timeout_ms, k.request_timeout_ms + 5),
            max_block_ms=k.max_block_ms, retry_backoff_ms=100, reconnect_backoff_max_ms=1000,
            bootstrap_timeout_ms=k.max_block_ms, allow_auto_create_topics=False,
        )

    def _topics_present(self) -> bool:
        if not self._check_topics:
            return True
        try:
            if self._admin is None:
                from kafka import KafkaAdminClient

                self._admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="adaflash-feedback-check",
                                               request_timeout_ms=self.kafka.request_timeout_ms,
                                               bootstrap_timeout_ms=self.kafka.max_block_ms)
            return self.topic in self._admin.list_topics()
        except Exception as e:  # noqa: BLE001 - broker unreachable
            log.debug("topic check failed: %s", type(e).__name__)
            return False

    def _connect(self) -> bool:
        try:
            if self._ensure_topics is not None:
                self._ensure_topics()
            self._kp = self._factory()
            self.counters["connects"] += 1
        except Exception as e:  # noqa: BLE001 - broker unreachable
            self.counters["connect_failures"] += 1
            log.debug("broker unreachable: %s", type(e).__name__)
            self._kp = None
            return False
        try:  # learn the topic's id before sending: records the broker lost go out first
            self._kp.partitions_for(self.topic)
            self._check_reset(force=True)
        except Exception as e:  # noqa: BLE001 - not known yet: the first batch looks again
            log.debug("topic metadata not known yet: %s", type(e).__name__)
        return True

    def _disconnect(self) -> None:
        # close(timeout=0) aborts what the old producer still holds: those records are
        # already on their way to the spool and must not be sent by it after a restart.
        kp, self._kp = self._kp, None
        admin, self._admin = self._admin, None
        for c in (kp, admin):
            if c is None:
                continue
            try:
                c.close(timeout=0) if c is kp else c.close()
            except Exception:  # noqa: BLE001
                pass

    def _spill_queue(self) -> None:
        """Move everything queued to the spool, in order."""
        batch: list[_Item] = []
        while True:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                break
        if batch:
            try:
                self._to_spool(batch)
            finally:
                self._resolved(len(batch))

    def _to_spool(self, items: list[_Item]) -> None:
        self.spool.append_many((it.scrubbed, it.traceparent) for it in items)
        self.counters["spooled"] += len(items)

    def _send_batch(self, items: list[_Item] | list[SpoolEntry]) -> int:
        """Send in order; returns how many leading items were acknowledged.

        Items behind the first failure are treated as failed too (re-sent later in
        order; the consumer de-duplicates by record_id if some got through).
        """
        kp = self._kp
        futures = []
        for it in items:
            try:
                futures.append(kp.send(self.topic, key=it.tenant_id.encode(), value=it.value,
                                       headers=_headers(it.traceparent)))
            except Exception as e:  # noqa: BLE001 - metadata timeout, buffer full, closed
                log.debug("send failed: %s", type(e).__name__)
                break
        try:
            kp.flush(timeout=self.kafka.request_timeout_ms / 1000 + 1)
        except Exception as e:  # noqa: BLE001
            log.debug("flush failed: %s", type(e).__name__)
        ok = 0
        for f in futures:
            if f.is_done and f.succeeded():
                ok += 1
            else:
                break
        if ok:
            self._check_reset(force=True)
            self._keep_acked(items[:ok])
        return ok

    # -- replay after a broker that came back empty ---------------------------------------
    def _keep_acked(self, items) -> None:
        if self.kafka.replay_window_records == 0:
            return
        now = time.monotonic()
        with self._lock:
            self._acked.extend(_Acked(now, it.tenant_id, self._topic_id, it.value, it.traceparent) for it in items)
            horizon = now - self.kafka.replay_window_s
            while self._acked and self._acked[0].at < horizon:
                self._acked.popleft()

    def _check_reset(self, force: bool = False) -> None:
        """Look at the topic's id in the producer's metadata; a new id means the broker lost
        its log: the records acknowledged under the old id go back into the spool."""
        now = time.monotonic()
        if self._kp is None or not (force or now - self._last_reset_check >= RESET_CHECK_S):
            return
        self._last_reset_check = now
        try:
            cluster = self._kp._metadata  # kafka-python's ClusterMetadata
            tid = cluster.topic_id(self.topic)
            if not force:
                cluster.request_update()  # fetched by the producer's own I/O thread
        except Exception:  # noqa: BLE001 - another client library, or closed
            return
        if tid is None or tid == self._topic_id:
            return
        old, self._topic_id = self._topic_id, tid
        with self._lock:
            if old is None:  # the first id seen: records acknowledged before it was known were under it
                self._acked = deque((a if a.topic_id is not None else
                                     _Acked(a.at, a.tenant_id, tid, a.value, a.traceparent) for a in self._acked),
                                    maxlen=self._acked.maxlen)
                return
            lost = [a for a in self._acked if a.topic_id != tid]
            self._acked = deque((a for a in self._acked if a.topic_id == tid), maxlen=self._acked.maxlen)
        self.counters["broker_resets"] += 1
        if lost:
            # ahead of what the spool holds: those came after them (the sender keeps order)
            stored = self.spool.append_many(((ScrubbedRecord(FeedbackRecord.from_bytes(a.value)), a.traceparent)
                                             for a in lost), front=True)
            self.counters["resent_after_reset"] += stored
        log.warning("feedback topic %s has a new id: the broker came back empty; %d records it had "
                    "acknowledged in the last %.0f s go out again", self.topic, len(lost),
                    self.kafka.replay_window_s)

    def _run(self) -> None:
        backoff = self.backoff_min
        while True:
            stopping = self._stop.is_set()
            if stopping and self._q.empty() and (self._kp is None or len(self.spool) == 0):
                return
            if self._kp is None:
                # while disconnected, new records wait in the spool (durable, in order)
                self._spill_queue()
                if stopping or not self._connect():
                    if stopping:
                        return
                    self._spill_queue()
                    self._stop.wait(backoff)
                    backoff = min(self.backoff_max, backoff * 2)
                    continue
                backoff = self.backoff_min
            # 1. the spool first, oldest first
            if len(self.spool) or not self._q.empty():
                if not self._topics_present():
                    self._disconnect()
                    continue
            if len(self.spool):
                entries = self.spool.peek(self.batch_size)
                ok = self._send_batch(entries)
                self.spool.ack(e.seq for e in entries[:ok])
                self.counters["replayed"] += ok
                if ok < len(entries):
                    self.counters["failed_batches"] += 1
                    self._disconnect()
                continue
            # 2. new records
            try:
                first = self._q.get(timeout=0.1)
            except queue.Empty:
                if self._acked:
                    self._check_reset()
                continue
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            try:
                ok = self._send_batch(batch)
                self.counters["sent"] += ok
                if ok < len(batch):
                    self.counters["failed_batches"] += 1
                    self._to_spool(batch[ok:])
                    self._disconnect()
            except Exception:  # noqa: BLE001 - never lose a batch to an unexpected error
                log.exception("producer batch error; spooling")
                self._to_spool(batch)
                self._disconnect()
            finally:
                self._resolved(len(batch))
