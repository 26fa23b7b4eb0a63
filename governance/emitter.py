"""The serving node's feedback emitter: off the serving path, fail closed.

``submit`` is called by the engine when a request finishes. It only puts the record on
a bounded queue and returns at once; when the queue is full the record is dropped and
counted (reason ``queue_full``), the request is never held up. A pool of workers then,
per record: reads the tenant policy (opt-out tenants never emit; the sampling rate
decides which records emit; a tenant whose policy is not known is treated as opted out
until it is: its records are held, bounded, and emitted or dropped once the policy is
known, or dropped with reason ``no_policy``), scrubs prompt and response (a scrub that raises, or takes
longer than ``scrub_timeout_s``, drops the record: reasons ``scrub_error`` /
``scrub_timeout``), and hands the scrubbed record to the producer.

Raw text is never logged, counted, spooled or sent: drop reasons and tenant ids are the
only labels, exceptions are reported by type name only.

Drop reasons: queue_full, closed, invalid_tenant, no_policy, opt_out, sampled_out,
scrub_error, scrub_timeout, producer_backlog, spool_overflow, spool_full, deleted,
internal_error.

Deletion requests: ``purge_stores(tenant, before)`` purges the tenant from every store
of the node (this queue, the producer's queue, the spool, usage-audit samples) and
drops its records created up to ``before`` that are still on their way (reason
``deleted``). Usage counts (per tenant and day: numbers, no content) stay for audit.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import UTC, datetime
from typing import Protocol

from opentelemetry.trace import Status, StatusCode

from adaflash import credentials
from adaflash.config import GovernanceConfig, Settings
from adaflash.contracts.feedback import FeedbackRecord
from adaflash.contracts.tenancy import TenantPolicy, valid_tenant_id
from adaflash.telemetry import DATAPLANE, SpanAttrs, Spans, extract_context, inject_traceparent, tracer
from governance.hold import HeldRecords
from governance.pii import ScrubbedRecord
from governance.policy import PolicySource, StaticPolicySource

log = logging.getLogger(__name__)
_tracer = tracer("adaflash.governance", service=DATAPLANE)  # a no-op until the node sets up telemetry

INVALID_TENANT_LABEL = "_invalid"


class RecordScrubber(Protocol):
    def scrub_record(self, record: FeedbackRecord) -> ScrubbedRecord: ...


class RecordSink(Protocol):
    def send(self, record: ScrubbedRecord, traceparent: str | None = None) -> bool: ...


def sampled(record_id: str, rate: float) -> bool:
    """Deterministic per-record sampling decision (the same record always decides alike)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return h / 2**64 < rate


class _Metrics:
    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        self.submitted = Counter("adaflash_feedback_submitted", "Feedback records submitted by the engine",
                                 ["tenant"], registry=self.registry)
        self.emitted = Counter("adaflash_feedback_emitted", "Scrubbed feedback records handed to the producer",
                               ["tenant"], registry=self.registry)
        self.dropped = Counter("adaflash_feedback_dropped", "Feedback records dropped, by reason",
                               ["tenant", "reason"], registry=self.registry)
        self.queue_depth = Gauge("adaflash_feedback_queue_depth", "Records waiting for a worker",
                                 registry=self.registry)
        self.spool_records = Gauge("adaflash_feedback_spool_records",
                                   "Records in the local spool (broker unreachable or behind)", registry=self.registry)
        self.held_records = Gauge("adaflash_feedback_held_records",
                                  "Records waiting for their tenant's policy", registry=self.registry)
        self.resent_after_reset = Gauge("adaflash_feedback_resent_after_broker_reset",
                                        "Acknowledged records sent again because the broker came back empty",
                                        registry=self.registry)


class FeedbackEmitter:
    name = "emitter_queue"

    def __init__(self, sink: RecordSink, scrubber: RecordScrubber | None = None,
                 policy: PolicySource | None = None, *, gov: GovernanceConfig | None = None,
                 usage=None, registry=None, workers: int | None = None, queue_size: int | None = None,
                 scrub_timeout_s: float | None = None, owns_sink: bool = False, closeables=(),
                 start: bool = True):
        self.gov = gov or GovernanceConfig()
        self.sink = sink
        self._scrubber = scrubber
        self.policy = policy or StaticPolicySource(gov=self.gov)
        self.usage = usage
        self.scrub_timeout_s = scrub_timeout_s if scrub_timeout_s is not None else self.gov.scrub_timeout_s
        self.n_workers = max(1, workers if workers is not None else self.gov.workers)
        self._q: queue.Queue = queue.Queue(maxsize=queue_size if queue_size is not None else self.gov.queue_size)
        self._owns_sink = owns_sink
        self._closeables = list(closeables)  # closed after the sink (spool, usage db)
        self._closed = False
        self._lock = threading.Lock()
        self._inflight = 0  # accepted by submit, not yet finished by a worker
        self._submitted: Counter[str] = Counter()
        self._emitted: Counter[str] = Counter()
        self._dropped: dict[str, Counter[str]] = defaultdict(Counter)
        self._usage_pending: Counter[tuple[str, str, str, str]] = Counter()
        self._deleted: dict[str, datetime] = {}  # tenant -> its records created up to it are dropped
        self._active: Counter[str] = Counter()  # per tenant: records a worker is processing now
        self._usage_flushed_at = time.monotonic()
        self._held = HeldRecords(self.gov.policy_hold_max, self.gov.policy_hold_s)
        self._held_retry_at = 0.0
        self.metrics = _Metrics(registry)
        self.metrics.held_records.set_function(lambda: len(self._held))
        spool = getattr(sink, "spool", None)
        if spool is not None:
            self.metrics.spool_records.set_function(lambda: len(spool))
        counters = getattr(sink, "counters", None)
        if isinstance(counters, dict):
            self.metrics.resent_after_reset.set_function(lambda: counters.get("resent_after_reset", 0))
        # Scrubbing runs on its own threads so a hung scrub can be abandoned: the worker
        # stops waiting after scrub_timeout_s. A bounded pool keeps hung scrubs bounded.
        self._scrub_pool = ThreadPoolExecutor(max_workers=2 * self.n_workers, thread_name_prefix="scrub")
        self._workers = [threading.Thread(target=self._work, name=f"feedback-worker-{i}", daemon=True)
                         for i in range(self.n_workers)]
        if start:
            for t in self._workers:
                t.start()

    @property
    def scrubber(self) -> RecordScrubber:
        if self._scrubber is None:
            from governance.pii import default_scrubber

            self._scrubber = default_scrubber()
        return self._scrubber

    @property
    def registry(self):
        return self.metrics.registry

    # -- serving path -----------------------------------------------------------------------
    def submit(self, record: FeedbackRecord, traceparent: str | None = None) -> bool:
        """Queue a finished request's record; never blocks, never raises. False if dropped."""
        try:
            tenant = record.tenant_id
            if not valid_tenant_id(tenant):
                self.count_drop(INVALID_TENANT_LABEL, "invalid_tenant")
                return False
            if self._closed:
                self.count_drop(tenant, "closed")
                return False
            with self._lock:
                self._inflight += 1
            try:
                self._q.put_nowait((record, traceparent))
            except queue.Full:
                with self._lock:
                    self._inflight -= 1
                self.count_drop(tenant, "queue_full")
                return False
            with self._lock:
                self._submitted[tenant] += 1
            self.metrics.submitted.labels(tenant).inc()
            self.metrics.queue_depth.set(self._q.qsize())
            return True
        except Exception as e:  # noqa: BLE001 - serving must go on
            log.error("feedback submit failed: %s", type(e).__name__)
            return False

    # -- accounting -----------------------------------------------------------------------
    def count_drop(self, tenant_id: str, reason: str, n: int = 1) -> None:
        """Count dropped records (also used by the spool for overflow)."""
        with self._lock:
            self._dropped[tenant_id][reason] += n
            self._usage_pending[(tenant_id, _today(), "dropped", reason)] += n
        self.metrics.dropped.labels(tenant_id, reason).inc(n)

    def _count_emitted(self, rec: ScrubbedRecord) -> None:
        t = rec.tenant_id
        day = _today()
        with self._lock:
            self._emitted[t] += 1
            self._usage_pending[(t, day, "emitted", "")] += 1
            for ent, n in rec.record.pii.items():
                self._usage_pending[(t, day, "entity", ent)] += n
        self.metrics.emitted.labels(t).inc()

    def counters(self) -> dict:
        """``{submitted: {tenant: n}, emitted: {tenant: n}, dropped: {tenant: {reason: n}}, queued}``."""
        with self._lock:
            return {"submitted": dict(self._submitted), "emitted": dict(self._emitted),
                    "dropped": {t: dict(c) for t, c in self._dropped.items()},
                    "queued": self._q.qsize(), "inflight": self._inflight, "held": len(self._held)}

    def flush_usage(self) -> None:
        if self.usage is None:
            return
        with self._lock:
            pending, self._usage_pending = self._usage_pending, Counter()
            self._usage_flushed_at = time.monotonic()
        if pending:
            try:
                self.usage._add([(t, d, k, n, c) for (t, d, k, n), c in pending.items()])
            except Exception as e:  # noqa: BLE001
                log.error("usage audit write failed: %s", type(e).__name__)

    # -- workers -------------------------------------------------------------------------
    def _policy_for(self, tenant: str) -> TenantPolicy | None:
        """The tenant's policy, or None when it is not known (fail closed: no default)."""
        try:
            p = self.policy.get(tenant)
        except Exception as e:  # noqa: BLE001 - a broken source means: no policy known
            log.warning("policy source failed: %s", type(e).__name__)
            return None
        return p if isinstance(p, TenantPolicy) and p.tenant_id == tenant else None

    def _work(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=min(1.0, self.gov.policy_retry_s))
            except queue.Empty:
                self._maybe_flush_usage()
                self._maybe_release_held()
                continue
            if item is None:
                return
            self.metrics.queue_depth.set(self._q.qsize())
            record, traceparent = item
            with self._lock:
                self._active[record.tenant_id] += 1
            try:
                self._process(record, traceparent)
            except Exception as e:  # noqa: BLE001
                log.error("feedback worker error: %s", type(e).__name__)
                self.count_drop(record.tenant_id, "internal_error")
            finally:
                with self._lock:
                    self._inflight -= 1
                    self._active[record.tenant_id] -= 1
                self._maybe_flush_usage()
                self._maybe_release_held()

    def _maybe_flush_usage(self) -> None:
        if self.usage is not None and time.monotonic() - self._usage_flushed_at > 1.0:
            self.flush_usage()

    def _maybe_release_held(self) -> None:
        """Every ``policy_retry_s``: drop held records past their age, and emit or drop
        those whose tenant's policy has become known."""
        if not len(self._held):
            return
        now = time.monotonic()
        with self._lock:
            if now < self._held_retry_at:
                return
            self._held_retry_at = now + self.gov.policy_retry_s
        for tenant, n in self._held.expire(now).items():
            self.count_drop(tenant, "no_policy", n)
        for tenant in self._held.tenants():
            policy = self._policy_for(tenant)
            if policy is not None:
                self._release(tenant, policy)

    def _release(self, tenant: str, policy: TenantPolicy) -> None:
        items = self._held.take(tenant)
        if not items:
            return
        with self._lock:
            self._active[tenant] += 1
        try:
            for record, traceparent in items:
                try:
                    self._apply(record, traceparent, policy)
                except Exception as e:  # noqa: BLE001
                    log.error("feedback worker error: %s", type(e).__name__)
                    self.count_drop(tenant, "internal_error")
        finally:
            with self._lock:
                self._active[tenant] -= 1

    def _process(self, record: FeedbackRecord, traceparent: str | None) -> None:
        tenant = record.tenant_id
        policy = self._policy_for(tenant)
        if policy is None:  # treated as opted out until the policy is known
            if not self._held.add(record, traceparent):
                self.count_drop(tenant, "no_policy")
            return
        self._release(tenant, policy)  # records held earlier go first
        self._apply(record, traceparent, policy)

    def _apply(self, record: FeedbackRecord, traceparent: str | None, policy: TenantPolicy) -> None:
        """Emit or drop one record under its tenant's known policy."""
        tenant = record.tenant_id
        if self._is_deleted(record):
            self.count_drop(tenant, "deleted")
            return
        if policy.opt_out:
            self.count_drop(tenant, "opt_out")
            return
        if not sampled(record.record_id, policy.sampling_rate):
            self.count_drop(tenant, "sampled_out")
            return
        # spans scrub and produce continue the request's trace; the Kafka header then names
        # the produce span, so the learner's train step links into the same trace
        parent = extract_context(traceparent) if traceparent else None
        attrs = {SpanAttrs.TENANT: tenant, SpanAttrs.RECORD_ID: record.record_id}
        with _tracer.start_as_current_span(Spans.SCRUB, context=parent, attributes=attrs) as span:
            fut = self._scrub_pool.submit(self.scrubber.scrub_record, record)
            try:
                scrubbed = fut.result(timeout=self.scrub_timeout_s)
            except FutureTimeout:
                fut.cancel()
                self.count_drop(tenant, "scrub_timeout")
                span.set_status(Status(StatusCode.ERROR, "scrub_timeout"))
                return
            except Exception as e:  # noqa: BLE001 - fail closed
                log.warning("scrub failed (%s): record dropped", type(e).__name__)
                self.count_drop(tenant, "scrub_error")
                span.set_status(Status(StatusCode.ERROR, "scrub_error"))
                return
            if not isinstance(scrubbed, ScrubbedRecord) or scrubbed.tenant_id != tenant:
                self.count_drop(tenant, "scrub_error")
                span.set_status(Status(StatusCode.ERROR, "scrub_error"))
                return
        if self._is_deleted(record):
            self.count_drop(tenant, "deleted")
            return
        with _tracer.start_as_current_span(Spans.PRODUCE, context=parent, attributes=attrs) as span:
            if not self.sink.send(scrubbed, inject_traceparent(span) or traceparent):
                self.count_drop(tenant, "producer_backlog")
                span.set_status(Status(StatusCode.ERROR, "producer_backlog"))
                return
        self._count_emitted(scrubbed)
        if self.usage is not None and self.usage.wants_sample(tenant):
            try:
                self.usage.add_sample(scrubbed)
            except Exception as e:  # noqa: BLE001
                log.error("sample write failed: %s", type(e).__name__)

    # -- deletion, shutdown -------------------------------------------------------------------
    def _is_deleted(self, record: FeedbackRecord) -> bool:
        cutoff = self._deleted.get(record.tenant_id)
        return cutoff is not None and record.created_at <= cutoff

    def stores(self) -> list:
        """Every store of this node holding the tenant's scrubbed records (``Purgeable``s):
        this queue, the producer's queue, the spool, the usage audit's samples."""
        out: list = [self]
        sink = self.sink
        if hasattr(sink, "purge_tenant"):
            out.append(sink)
        spool = getattr(sink, "spool", None)
        if spool is not None:
            out.append(spool)
        if self.usage is not None:
            out.append(self.usage)
        return out

    def purge_stores(self, tenant_id: str, before: datetime, *, wait_s: float | None = None):
        """Execute a deletion request on this node: purge every store of ``tenant_id``.

        First the tenant's records created up to ``before`` are refused from now on (by
        the workers and by the spool), then a record a worker is processing finishes
        (at most one scrub timeout), then each store is purged. Returns a
        ``governance.retention.PurgeReport``; a store in ``failed`` needs another try.
        """
        from governance.retention import purge_tenant as purge

        before = before if before.tzinfo else before.replace(tzinfo=UTC)
        with self._lock:
            old = self._deleted.get(tenant_id)
            self._deleted[tenant_id] = max(old, before) if old else before
        spool = getattr(self.sink, "spool", None)
        if spool is not None and hasattr(spool, "refuse_before"):
            spool.refuse_before(tenant_id, before)
        queued = self.purge_tenant(tenant_id)  # nothing queued reaches a worker any more
        deadline = time.monotonic() + (wait_s if wait_s is not None else self.scrub_timeout_s + 5.0)
        while time.monotonic() < deadline:
            with self._lock:
                if self._active[tenant_id] <= 0:
                    break
            time.sleep(0.02)
        report = purge(tenant_id, self.stores())
        report.purged[self.name] = report.purged.get(self.name, 0) + queued
        return report

    def purge_tenant(self, tenant_id: str) -> int:
        """Drop the tenant's records still waiting in the queue or for its policy; returns how many."""
        with self._q.mutex:
            keep = [it for it in self._q.queue if it is None or it[0].tenant_id != tenant_id]
            n = len(self._q.queue) - len(keep)
            self._q.queue.clear()
            self._q.queue.extend(keep)
            self._q.not_full.notify_all()
        if n:
            with self._lock:
                self._inflight -= n
        n += len(self._held.take(tenant_id))
        if n:
            self.count_drop(tenant_id, "deleted", n)
        return n

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every accepted record is processed (emitted or dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._inflight <= 0:
                    return True
            time.sleep(0.02)
        return False

    def close(self, timeout: float = 30.0) -> bool:
        """Stop accepting, process what is queued (up to ``timeout``), stop the workers."""
        self._closed = True
        done = self.drain(timeout)
        for _ in self._workers:
            try:
                self._q.put(None, timeout=1.0)
            except queue.Full:
                pass
        for t in self._workers:
            if t.is_alive():
                t.join(timeout=2.0)
        self._scrub_pool.shutdown(wait=False, cancel_futures=True)
        for tenant, n in self._held.clear().items():  # policy still unknown at shutdown
            self.count_drop(tenant, "no_policy", n)
        self.flush_usage()
        if self._owns_sink and hasattr(self.sink, "close"):
            self.sink.close()
        for c in self._closeables:
            c.close()
        return done


def _today() -> str:
    return datetime.now(UTC).date().isoformat()


def build_emitter(settings: Settings, *, bootstrap: str | None = None, policy: PolicySource | None = None,
                  scrubber: RecordScrubber | None = None, registry=None, retention_ms: int | None = None):
    """Wire spool + producer + usage audit + emitter from settings (what a node runs).

    Returns the emitter; its ``sink`` is the producer (closed with the emitter).
    """
    from governance.producer import FeedbackProducer
    from governance.retention import topic_retention_ms
    from governance.spool import Spool
    from governance.usage_audit import UsageAudit

    gov = settings.governance
    gdir = settings.home / "governance"
    if policy is None:
        if settings.dataplane.controlplane_url:
            from governance.policy import HttpPolicySource

            token = credentials.lookup(credentials.node_controlplane(settings))
            policy = HttpPolicySource(settings.dataplane.controlplane_url, ttl_s=gov.policy_ttl_s,
                                      timeout_s=gov.policy_timeout_s, retry_s=gov.policy_retry_s, token=token)
        else:
            policy = StaticPolicySource(gov=gov)
    spool = Spool(gov.spool_path or gdir / "spool.db", gov.spool_max_records, gov.spool_overflow)
    usage = UsageAudit(gov.usage_db_path or gdir / "usage.db")
    if retention_ms is None:
        pols = policy.all() if hasattr(policy, "all") else []
        retention_ms = topic_retention_ms(pols, gov.default_ttl_days)
    producer = FeedbackProducer(bootstrap or settings.kafka.bootstrap, spool, settings.kafka,
                                retention_ms=retention_ms)
    closeables: list = [spool, usage]
    if scrubber is None and gov.scrubber == "process":
        from governance.scrub_process import ProcessScrubber

        scrubber = ProcessScrubber(nice=gov.scrub_nice, score_threshold=gov.pii_score_threshold)
        scrubber.warm()
        closeables.append(scrubber)
    emitter = FeedbackEmitter(producer, scrubber, policy, gov=gov, usage=usage, registry=registry, owns_sink=True,
                              closeables=closeables)
    spool.on_drop = emitter.count_drop
    return emitter
