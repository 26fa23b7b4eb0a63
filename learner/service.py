"""The learner: consume feedback -> buffer -> supervise -> train -> checkpoint -> commit -> publish.

One loop, one step at a time::

    poll the feedback topic
      tenant deleted (record created up to the request) -> skipped, never used
      record already trained (checkpointed ``seen``)   -> skip
      bad schema / unknown target / too long / short   -> DLQ with the reason
      expired or opted out (tenant policy)             -> dropped, counted
      older than max_record_age_s (learner behind)     -> dropped as "stale", counted
      else                                             -> replay buffer (share cap, TTL)
    buffer ready (full, or its oldest record waited max_wait_s), learning not held (controlplane/hold.py)
      records claimed at the control plane; another learner's -> finished, not trained
      target supervision, ``epochs`` passes of OPD + length head
      DLQ flushed; checkpoint committed (weights, optimizer, seen, ledger, offsets, lineage)
      Kafka offsets committed (never past a record still held in the buffer)
      every ``publish_every`` steps: candidate to MLflow

Exactly once: a record counts as trained when the checkpoint transaction that lists
it commits, together with the weights it moved. A learner killed anywhere restarts
from that checkpoint and re-reads from its offsets; a record in a lost step is
re-read and trained again, but the lost step's weights went with it, so the
surviving weights saw every record once (``trained`` is the ledger that shows it).

``ADAFLASH_LEARNER_CRASH=phase:step`` kills the process (SIGKILL, no clean-up) at a
named phase of a step (after_train, after_weights, after_checkpoint, after_commit) so
recovery can be tested against a real broker.

Across learners (learner/claims.py, controlplane/claims.py): Kafka's committed offsets keep
them off each other's records, and claims keep that true when a broker that came back empty
hands records one learner trained to another.

Deletion requests (learner/deletion.py): between steps the learner purges a deleted
tenant from its buffer, deferred records and checkpoint ledger and acknowledges it to
the control plane.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from adaflash.config import Settings
from adaflash.contracts.feedback import FeedbackRecord, InvalidRecord
from adaflash.contracts.manifest import Lineage, OffsetRange
from adaflash.telemetry import (
    LEARNER,
    SpanAttrs,
    Spans,
    links_from_traceparents,
    traceparent_from_headers,
    tracer,
)
from dataplane.runner import load_training_target
from dataplane.spec_policy import PolicyConfig
from dataplane.target_cache import target_identity
from dataplane.tokenizer import Tokenizer
from learner.buffer import DROPPED, Item, PolicySource, ReplayBuffer
from learner.checkpoint import CheckpointStore, Done
from learner.startup import initial_drafter, policy_source, state_dir
from learner.supervision import BAD_SCHEMA, Supervisor, Unusable
from learner.trainer import Trainer

log = logging.getLogger("adaflash.learner")
CLAIM_RETRY_S = 5.0  # how long a step waits after records another learner held were put back
_tracer = tracer(__name__, service=LEARNER)

CRASH_ENV = "ADAFLASH_LEARNER_CRASH"


def _crash_point(phase: str, step: int) -> None:
    want = os.environ.get(CRASH_ENV, "")
    if want and want == f"{phase}:{step}":
        log.warning("crash point %s reached: SIGKILL", want)
        os.kill(os.getpid(), signal.SIGKILL)


class Learner:
    def __init__(self, settings: Settings, policy: PolicySource | None = None, publisher=None):
        self.settings = settings
        self.cfg = settings.learner
        self.topic = settings.kafka.feedback_topic
        tdir, self.target = load_training_target(settings)
        self.identity = target_identity(tdir)
        drafter, parent = initial_drafter(settings, self.target, self.identity)
        self.drafter = drafter
        self.supervisor = Supervisor(self.target, Tokenizer(tdir), self.identity, drafter.config.target_layers,
                                     self.cfg.max_record_tokens, self.cfg.min_response_tokens,
                                     self.cfg.supervise_chunk_tokens, self.cfg.prompt_format)
        self.trainer = Trainer(drafter, self.supervisor, self.cfg, PolicyConfig.of(settings.dataplane))
        self.store = CheckpointStore(state_dir(settings), keep=self.cfg.keep_checkpoints)
        if self.store.load_into(drafter, self.trainer.opt):
            log.info("resumed at step %s", self.store.step)
        elif parent is not None and self.store.meta("parent_version") is None:
            self.store.set_meta({"parent_version": parent})
        self.buffer = ReplayBuffer(self.cfg.buffer_size, policy or policy_source(settings), self.cfg.max_wait_s,
                                   self.cfg.max_deferred, max_age_s=self.cfg.max_record_age_s)
        self.publisher = publisher
        self.consumer = None
        self.consumed_next: dict[int, int] = {}
        # records of partitions revoked by a rebalance still under way: kept aside until the
        # assignment says whether the partition came back (see ``_revoked``)
        self.suspended: list[Item] = []
        self.suspended_parts: set[int] = set()
        self.done: list[Done] = []  # records finished without training since the last checkpoint
        self.dirty = False  # offsets moved past records that need no training (DLQ, skips)
        self.counters: dict[str, int] = defaultdict(int)
        self.stop_event = threading.Event()
        self.deleted = self.store.deleted_before()  # tenant -> its records up to it are refused
        from learner.deletion import DeletionPoller

        self.deletions = DeletionPoller.from_settings(self)
        from learner.claims import RecordClaims

        # one learner trains each record across the group (controlplane/claims.py)
        self.claims = RecordClaims(self.deletions.client, self.cfg.learner_id) if self.deletions else None
        from learner.hold import HoldWatch

        # the fleet's learning hold (controlplane/hold.py): no step while an admin holds learning
        self.hold = HoldWatch(self.deletions.client, self.cfg.learner_id, self.cfg.hold_poll_s) if self.deletions else None
        self._next_step_at = 0.0  # after records another learner held went back: not before this
        from learner.resilience import BrokerWatch

        self.epoch = 0  # bumped when the broker comes back empty (learner/resilience.py)
        self.epoch_read: set[int] = set()  # partitions read from in this epoch
        self.watch = BrokerWatch(self)
        # The consumer's rebalance callbacks run on the client's I/O thread; they take this
        # lock to touch the buffer.
        self._lock = threading.RLock()

    # --- Kafka ------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Create the topics and join the group, waiting for the broker as long as it takes."""
        from kafka.errors import KafkaError

        from learner.consumer import FeedbackConsumer

        while True:
            try:
                self.ensure_topics()
                self.consumer = FeedbackConsumer(self.settings.kafka, self.cfg, self._revoked,
                                                 on_assigned=self._assigned)
                return
            except KafkaError as e:
                if self.stop_event.wait(2.0):
                    raise
                log.warning("broker unavailable (%s); trying again", type(e).__name__)

    def ensure_topics(self) -> None:
        """Create missing topics with the default TTL; existing ones are left alone."""
        from adaflash.contracts.topics import default_retention_ms, ensure_topics

        kc = self.settings.kafka
        ensure_topics(kc.bootstrap, kc, default_retention_ms(self.settings.governance), update_existing=False)

    def _assigned(self, partitions: set[int]) -> None:
        """The rebalance's outcome. A revoked partition assigned to us again keeps its fetch
        position (the client preserves the state of partitions in both assignments), so its
        records set aside at the revocation go back into the buffer: dropped, they would never
        be read again and the next commit would move past them. Records of partitions now
        owned elsewhere are forgotten; the next owner re-reads them from the committed offsets
        (they wait a while in case the broker restarted empty: then nobody can).

        After the broker came back empty, a partition not yet read in this epoch starts at
        offset 0, whatever the group says: offsets committed to the new broker before the
        reset was noticed came from positions in the old log, and a rejoin that completes
        after the reset's seek would resume from them and skip the new records."""
        with self._lock:
            lost = self.suspended_parts - partitions
            back, gone = [], []
            for it in self.suspended:
                (back if it.partition in partitions else gone).append(it)
            self.suspended, self.suspended_parts = [], set()
            for it in back:
                self.buffer.offer(it)
            # records handled from a fetch made before the revocation, of a partition now elsewhere
            gone += self.buffer.drop_partitions(lost, epoch=self.epoch)
            self.watch.revoked(gone)
            for p in lost:
                self.consumed_next.pop(p, None)
            if back or gone:
                log.info("rebalance: %d held records kept (partitions %s), %d forgotten (partitions %s)",
                         len(back), sorted(partitions), len(gone), sorted(lost))
            fresh = partitions - self.epoch_read
            if self.epoch > 0 and fresh:
                self.consumer.seek_to_start(fresh)
                log.info("epoch %d: partitions %s read from offset 0", self.epoch, sorted(fresh))

    def _revoked(self, partitions: set[int]) -> None:
        """A rebalance took ``partitions`` away, perhaps to hand them back: their held records
        are set aside (not trained, still holding the offsets back) until ``_assigned``."""
        with self._lock:
            self.suspended.extend(self.buffer.drop_partitions(partitions, epoch=self.epoch))
            self.suspended_parts |= partitions

    def on_broker_reset(self) -> None:
        """The broker came back empty: a new epoch reads every partition from its start."""
        with self._lock:
            self.epoch += 1
            self.consumed_next = {}
            self.epoch_read = set()
            back = [self._count(self.buffer.offer(it)) for it in self.watch.take_limbo()]
            self.counters["broker_resets"] += 1
            self.consumer.seek_to_start()
        log.warning("broker reset: epoch %d, %d held records kept, %d revoked ones taken back", self.epoch,
                    len(self.buffer.held()), back.count("buffered") + back.count("deferred"))

    def handle(self, msg) -> str:
        """Route one consumed message; returns its outcome."""
        with self._lock:
            return self._handle(msg)

    def _handle(self, msg) -> str:
        self.consumed_next[msg.partition] = msg.offset + 1
        self.epoch_read.add(msg.partition)
        try:
            record = FeedbackRecord.from_bytes(msg.value)
        except InvalidRecord as e:
            return self._dlq(msg, BAD_SCHEMA, str(e))
        cutoff = self.deleted.get(record.tenant_id)
        if cutoff is not None and record.created_at <= cutoff:
            self.dirty = True  # offsets may move past it; Kafka retention removes it
            return self._count("deleted")
        if self.store.seen(record.record_id):
            log.info("record %s at %s/%s already trained: skipped", record.record_id, msg.partition, msg.offset)
            self.dirty = True  # offsets may move past it (a record sent again)
            return self._count("already_trained")
        try:
            tok = self.supervisor.tokenize(record)
        except Unusable as e:
            return self._dlq(msg, e.reason, e.detail)
        outcome = self.buffer.offer(Item(tok, msg.partition, msg.offset,
                                         traceparent=traceparent_from_headers(msg.headers), epoch=self.epoch))
        if outcome in (*DROPPED, "held_out"):  # finished without training: in the ledger, never re-read
            self.done.append(Done(record.record_id, record.tenant_id, outcome, record.created_at.isoformat()))
            self.dirty = True
        elif outcome == "duplicate":
            self.dirty = True
        return self._count(outcome)

    def _dlq(self, msg, reason: str, detail: str) -> str:
        self.consumer.to_dlq(msg, reason, detail)
        self.dirty = True
        return self._count("dlq:" + reason)

    def _count(self, outcome: str) -> str:
        self.counters[outcome] += 1
        return outcome

    def safe_offsets(self) -> dict[int, int]:
        """Per partition, the next offset to resume from: nothing at or after a held record
        (of this epoch: a record read before the broker came back empty has no offset now)."""
        out = dict(self.consumed_next)
        for it in self.buffer.held() + self.suspended:
            if it.partition in out and it.epoch == self.epoch:
                out[it.partition] = min(out[it.partition], it.offset)
        return out

    # --- deletion -----------------------------------------------------------------------------------
    def purge_tenant(self, tenant_id: str, before) -> tuple[dict[str, int], dict]:
        """Execute a deletion request: the tenant's records leave every store of the learner.

        Its records created up to ``before`` are refused from now on (persisted); the
        buffer and deferred records drop them; records finished but not yet checkpointed
        are forgotten (they would write their ids); the checkpoint replaces their ids by
        hashes. Returns (store -> count, detail for the acknowledgement)."""
        with self._lock:
            ledger = self.store.purge_tenant(tenant_id, before)  # persists the cut-off first
            self.deleted = self.store.deleted_before()
            buffered, deferred = self.buffer.purge_tenant(tenant_id)
            kept = [it for it in self.suspended if it.record.tenant_id != tenant_id]
            buffered += len(self.suspended) - len(kept)
            self.suspended = kept
            pending = [d for d in self.done if d.tenant_id == tenant_id]
            self.done = [d for d in self.done if d.tenant_id != tenant_id]
            if buffered or deferred or pending:
                self.dirty = True
        lineage = self.store.meta("lineage_pending") or {}
        trained_in = bool(ledger["ledger"]) or any(
            1 for _ in self.store.db.execute("SELECT 1 FROM trained WHERE tenant_id = ? LIMIT 1", (tenant_id,)))
        detail = {"weights_trained_on_tenant": trained_in,
                  "unpublished_steps_trained_on_tenant": tenant_id in (lineage.get("tenants") or []),
                  "parent_version": self.store.meta("parent_version")}
        purged = {"replay_buffer": buffered, "deferred": deferred, "unfinished": len(pending),
                  "ledger_ids": ledger["ledger"], "dedup_ids": ledger["seen"]}
        return purged, detail

    # --- one training step ------------------------------------------------------------------------
    def step(self) -> dict[str, float] | None:
        with self._lock:
            items, gone = self.buffer.take()
        items, elsewhere = self._claim(items)
        step = self.store.step + 1
        links = links_from_traceparents(i.traceparent for i in items)
        with _tracer.start_as_current_span(Spans.TRAIN_STEP, links=links,
                                           attributes={SpanAttrs.RECORDS: len(items), "step": step}) as span:
            metrics = self._step(step, items, gone, elsewhere)
            for key in ("loss", "head_mae", "clip_ratio", "sim_tau"):
                if key in metrics:
                    span.set_attribute(key, metrics[key])
        if items:
            self._maybe_publish(step, metrics)
        return metrics

    def _claim(self, items: list[Item]) -> tuple[list[Item], list[Item]]:
        """Claim ``items`` at the control plane: returns (those to train, those another learner
        trained). Those another learner holds go back into the buffer, and the next step waits
        CLAIM_RETRY_S (their claims lapse if their holder died mid-step)."""
        if self.claims is None or not items:
            return items, []
        train, elsewhere, held = self.claims.sort(items)
        if held:
            with self._lock:
                for it in held:
                    self.buffer.offer(it)
            self._next_step_at = time.monotonic() + CLAIM_RETRY_S
        self.counters["trained_elsewhere"] += len(elsewhere)
        return train, elsewhere

    def _step(self, step: int, items: list[Item], gone: list[Item],
              elsewhere: Sequence[Item] = ()) -> dict[str, float]:
        done = self.done + [Done(i.record.record_id, i.record.tenant_id, why or self.buffer.usable(i.record) or "expired",
                                 i.record.created_at.isoformat())
                            for why, its in ((None, gone), ("trained_elsewhere", elsewhere)) for i in its]
        metrics: dict[str, float] = {}
        if items:
            t0 = time.monotonic()
            sups = self.supervisor.supervise([i.tok for i in items])
            t1 = time.monotonic()
            metrics = self.trainer.train_buffer(sups, step)
            metrics.update(supervise_s=t1 - t0, train_s=time.monotonic() - t1)
            done += [Done(i.record.record_id, i.record.tenant_id, "trained", i.record.created_at.isoformat())
                     for i in items]
        _crash_point("after_train", step)
        self._checkpoint(step, done, items, metrics)
        if items:
            log.info("step %s: %d records, loss %.4f, head_mae %.3f, sim_tau %.2f", step, len(items),
                     metrics.get("loss", float("nan")), metrics.get("head_mae", float("nan")),
                     metrics.get("sim_tau", float("nan")))
        return metrics

    def _checkpoint(self, step: int, done: list[Done], items: list[Item], metrics: dict,
                    new_weights: bool = True) -> None:
        if self.consumer is not None:
            self.consumer.flush_dlq(stop=self.stop_event)  # waits for a broker that went away
        if new_weights:
            weights = self.store.write_weights(step, self.drafter, self.trainer.opt)
            _crash_point("after_weights", step)
        else:
            weights = self.store.meta("weights")
        with self._lock:
            offsets = self.safe_offsets()
        meta = {"lineage_pending": self._lineage_update(items), "last_metrics": metrics} if items else {}
        self.store.commit(step, weights, done, self.topic, offsets, meta)
        self.done, self.dirty = [], False
        _crash_point("after_checkpoint", step)
        if items and self.claims is not None:  # checkpointed: final claims, before offsets move past them
            self.claims.trained([i.record.record_id for i in items])
        if self.consumer is not None:
            self.consumer.commit(offsets)
        _crash_point("after_commit", step)

    def _lineage_update(self, items: list[Item]) -> dict:
        lin = self.store.meta("lineage_pending") or {"offsets": {}, "tenants": [], "window": [None, None]}
        for it in items:
            key = str(it.partition)
            lo, hi = lin["offsets"].get(key, [it.offset, it.offset])
            lin["offsets"][key] = [min(lo, it.offset), max(hi, it.offset)]
        lin["tenants"] = sorted(set(lin["tenants"]) | {i.record.tenant_id for i in items})
        times = [i.record.created_at.isoformat() for i in items] + [t for t in lin["window"] if t]
        lin["window"] = [min(times), max(times)]
        return lin

    # --- publishing -------------------------------------------------------------------------------
    def lineage(self) -> Lineage:
        lin = self.store.meta("lineage_pending") or {"offsets": {}, "tenants": [], "window": [None, None]}
        return Lineage(topic=self.topic, source="online", parent_version=self.store.meta("parent_version"),
                       offsets=[OffsetRange(partition=int(p), start=r[0], end=r[1])
                                for p, r in sorted(lin["offsets"].items(), key=lambda kv: int(kv[0]))],
                       tenants=lin["tenants"], window_start=lin["window"][0], window_end=lin["window"][1])

    def params(self) -> dict[str, object]:
        c = self.cfg
        return {"loss": c.loss, "alpha": c.alpha, "delta": c.delta, "lr_drafter": c.lr_drafter, "lr_head": c.lr_head,
                "buffer_size": c.buffer_size, "epochs": c.epochs, "grad_accum": c.grad_accum,
                "anchors_per_record": c.anchors_per_record, "head_label": c.head_label,
                "block_size": self.drafter.config.block_size}

    def _maybe_publish(self, step: int, metrics: dict[str, float]) -> None:
        every = self.cfg.publish_every
        if self.publisher is None or not every or step % every:
            return
        with _tracer.start_as_current_span(Spans.PUBLISH, attributes={"step": step}) as span:
            try:
                pub = self.publisher.publish(self.drafter, self.lineage(), self.params(), metrics,
                                             training={"step": step, "ledger_records": len(self.store.ledger())},
                                             step=step)
            except Exception as e:  # noqa: BLE001 - registry down: keep training, lineage stays pending
                log.error("step %s: publishing failed (%s); the next publish carries this lineage", step, e)
                span.record_exception(e)
                return
            span.set_attribute(SpanAttrs.VERSION, pub.version)
        self.store.set_meta({"parent_version": pub.version, "lineage_pending": None, "published_step": step})
        log.info("step %s published as version %s (run %s)", step, pub.version, pub.run_id)

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, exit_when_idle_s: float | None = None) -> int:
        """Run until stopped, ``max_steps`` steps, or ``exit_when_idle_s`` without records. Returns steps run."""
        if self.consumer is None:
            self.connect()
        steps, idle_since = 0, time.monotonic()
        try:
            while not self.stop_event.is_set():
                if self.deletions is not None:
                    self.deletions.maybe_tick()
                self._shed_stale()
                msgs = self._poll()
                for m in msgs:
                    self.handle(m)
                if msgs or not self.consumer.assigned():
                    idle_since = time.monotonic()  # idle only counts once the group gave us partitions
                held = self.hold is not None and self.hold.maybe_tick()
                if not held and self.buffer.ready() and time.monotonic() >= self._next_step_at:
                    self.step()
                    steps += 1
                    if max_steps is not None and steps >= max_steps:
                        break
                elif not msgs and self.dirty:
                    # move the offsets past DLQ'd and dropped records; the weights do not change
                    self._checkpoint(self.store.step, self.done, [], {}, new_weights=False)
                if (exit_when_idle_s is not None and not msgs and not self.buffer.held()
                        and time.monotonic() - idle_since >= exit_when_idle_s):
                    break
                if held and not msgs:  # the buffer is full or the topic quiet: wait, do not spin
                    self.stop_event.wait(0.2)
        finally:
            self.close()
        return steps

    def _shed_stale(self) -> None:
        """Finish untrained the held records that waited past max_record_age_s (a learner behind its
        traffic keeps up with the fresh part of it; the offsets then move past the shed ones)."""
        with self._lock:
            for it in self.buffer.shed_stale():
                r = it.record
                self.done.append(Done(r.record_id, r.tenant_id, "stale", r.created_at.isoformat()))
                self.dirty = True
                self._count("stale")

    def _poll(self) -> list:
        """Fetch what the buffer has room for; a broker that is away or came back empty is
        waited for and recovered from here (learner/resilience.py), never a reason to exit."""
        from kafka.errors import KafkaError

        try:
            self.watch.tick()
            if self.buffer.wants_more():
                self.consumer.resume()
                return self.consumer.poll(self.cfg.poll_timeout_ms)
            self.consumer.pause()
        except KafkaError as e:
            self.counters["broker_errors"] += 1
            log.warning("broker error (%s: %s); retrying", type(e).__name__, e)
            self.stop_event.wait(1.0)
        return []

    def close(self) -> None:
        if self.counters:
            log.info("outcomes: %s; buffer drops: %s", dict(self.counters), dict(self.buffer.dropped))
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        if self.claims is not None:
            self.claims.flush()
            self.claims = None
        if self.deletions is not None:
            self.deletions.close()
            self.deletions = None
        self.store.close()
