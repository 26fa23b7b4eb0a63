"""Feedback records built off the engine thread.

When a request finishes, the engine hands its sequence and envelope to ``Node``, which
takes a ``FinishedRequest`` (a copy of the token ids, rounds and timings: the engine
thread pays for a few list copies, nothing more) and queues it here. A worker thread
detokenizes, builds the ``FeedbackRecord`` and submits it to the governance emitter,
which scrubs and produces it on its own threads. A full queue drops the record and
counts it; nothing here ever blocks or fails a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from adaflash.contracts.feedback import FeedbackRecord, Round, Sampling, Stats, TargetRef
from dataplane.envelope import RequestEnvelope
from dataplane.sequence import Sequence
from dataplane.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("adaflash.feedback")

QUEUE_SIZE = 4096  # finished requests waiting for their record; beyond it they are dropped


@dataclass(frozen=True)
class FinishedRequest:
    """What a feedback record is built from, copied off the finished sequence."""

    request_id: str
    tenant_id: str
    envelope: RequestEnvelope
    output_ids: list[int]
    stop: list[str]
    temperature: float
    top_p: float
    drafter_version: str | None
    rounds: list[tuple[int, int, float]] = field(default_factory=list)  # (k_hat, accepted, a_hat)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @classmethod
    def of(cls, seq: Sequence, envelope: RequestEnvelope | None) -> FinishedRequest:
        p = seq.params
        return cls(seq.request_id, seq.tenant_id, envelope or RequestEnvelope(), list(seq.output_ids),
                   list(p.stop), p.temperature, p.top_p, seq.drafter_version,
                   [(r.k_hat, r.accepted, r.a_hat) for r in seq.rounds], seq.draft_s, seq.verify_s)


def build_record(done: FinishedRequest, tokenizer: Tokenizer, node_id: str, identity: dict,
                 mode: str) -> FeedbackRecord:
    """The raw (unscrubbed) record of a finished request; the emitter scrubs it."""
    detok = Detokenizer(tokenizer, done.stop)
    detok.update(done.output_ids, final=True)
    rounds = [Round(k_hat=k, accepted=a, a_hat=min(1.0, max(0.0, ah))) for k, a, ah in done.rounds]
    n = len(rounds)
    accepted = sum(r.accepted for r in rounds)
    return FeedbackRecord(
        tenant_id=done.tenant_id,
        node_id=node_id,
        request_id=done.request_id,
        target_model=TargetRef(**identity),
        drafter_version=done.drafter_version or "none",
        mode=mode,
        sampling=Sampling(temperature=done.temperature, top_p=done.top_p),
        domain=done.envelope.domain,
        prompt_text=done.envelope.prompt_text,
        response_text=detok.text,
        rounds=rounds,
        stats=Stats(tau_mean=(accepted + n) / n if n else 0.0, verify_tokens=sum(r.k_hat for r in rounds),
                    draft_ms=done.draft_s * 1000.0, verify_ms=done.verify_s * 1000.0),
    )


class FeedbackBuilder:
    """A queue and one worker thread: ``build(done)`` then ``emit(record, traceparent)``."""

    def __init__(self, build: Callable[[FinishedRequest], FeedbackRecord],
                 emit: Callable[[FeedbackRecord, str | None], object], queue_size: int = QUEUE_SIZE):
        self._build, self._emit = build, emit
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._pending = 0  # queued or being built
        self.dropped = 0  # queue full, or the build failed
        self._thread = threading.Thread(target=self._work, name="feedback-builder", daemon=True)
        self._thread.start()

    def submit(self, done: FinishedRequest) -> bool:
        """Queue a finished request (engine thread): never blocks. False when dropped."""
        with self._lock:
            self._pending += 1
        try:
            self._q.put_nowait(done)
            return True
        except queue.Full:
            with self._lock:
                self._pending -= 1
                self.dropped += 1
            return False

    def _work(self) -> None:
        while True:
            done = self._q.get()
            if done is None:
                return
            try:
                self._emit(self._build(done), done.envelope.traceparent)
            except Exception:  # a record that cannot be built is dropped, serving goes on
                log.exception("feedback record for %s not built", done.request_id)
                with self._lock:
                    self.dropped += 1
            finally:
                with self._lock:
                    self._pending -= 1

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued request's record was handed on (or dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending <= 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> bool:
        done = self.drain(timeout)
        self._q.put(None)
        self._thread.join(timeout=2.0)
        return done
