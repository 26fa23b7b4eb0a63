"""Scrubbing in a separate, lower-priority process.

Presidio and spaCy are pure-Python heavy: run in the serving process they hold the GIL
and compete with the engine loop. ``ProcessScrubber`` keeps the scrubber in a child
process (spawned, niced), so the serving process only pickles text across a pipe and
waits with the GIL released. A dead or hung child fails closed: the call raises, the
emitter drops and counts the record, and the next call starts a fresh child.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading

from adaflash.contracts.feedback import FeedbackRecord
from governance.pii import ScrubbedRecord, ScrubError, _merge

log = logging.getLogger("adaflash.governance.scrub_process")


def _child(conn, nice: int, threshold: float) -> None:
    os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
    try:
        os.nice(nice)
    except OSError:
        pass
    from governance.pii import Scrubber

    scrubber = Scrubber(score_threshold=threshold)
    conn.send(("ready", None))
    while True:
        try:
            texts = conn.recv()
        except EOFError:
            return
        if texts is None:
            return
        try:
            conn.send(("ok", [(r.text, r.counts) for r in scrubber.scrub_texts(texts)]))
        except Exception as e:  # noqa: BLE001 - the parent fails closed on any error
            conn.send(("error", type(e).__name__))


class ProcessScrubber:
    """Implements ``scrub_record`` like ``governance.pii.Scrubber``, in a child process."""

    def __init__(self, nice: int = 10, score_threshold: float = 0.3, start_timeout_s: float = 120.0):
        self.nice = nice
        self.threshold = score_threshold
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def warm(self) -> threading.Thread:
        """Start the child in the background so the first records need not wait for spaCy."""

        def start():
            try:
                with self._lock:
                    self._ensure()
            except ScrubError as e:
                log.warning("scrubber warm-up failed: %s", e)

        t = threading.Thread(target=start, name="adaflash-scrubber-warmup", daemon=True)
        t.start()
        return t

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, self.nice, self.threshold), daemon=True,
                           name="adaflash-scrubber")
        proc.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            proc.kill()
            raise ScrubError("scrubber process did not start in time")
        status, _ = parent.recv()
        if status != "ready":
            proc.kill()
            raise ScrubError("scrubber process failed to start")
        self._proc, self._conn = proc, parent

    def _restart(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def scrub_texts(self, texts: list[str], timeout_s: float = 30.0) -> list[tuple[str, dict]]:
        with self._lock:
            self._ensure()
            try:
                self._conn.send(texts)
                if not self._conn.poll(timeout_s):
                    self._restart()
                    raise ScrubError("scrubber process timed out")
                status, payload = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                self._restart()
                raise ScrubError(f"scrubber process died: {type(e).__name__}") from e
        if status != "ok":
            raise ScrubError(f"scrubbing failed in the child: {payload}")
        return payload

    def scrub_record(self, record: FeedbackRecord) -> ScrubbedRecord:
        (p_text, p_counts), (r_text, r_counts) = self.scrub_texts([record.prompt_text, record.response_text])
        clean = record.model_copy(update={"prompt_text": p_text, "response_text": r_text,
                                          "pii": _merge(record.pii, p_counts, r_counts)})
        return ScrubbedRecord(clean)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            if self._proc is not None:
                self._proc.join(timeout=5)
                if self._proc.is_alive():
                    self._proc.kill()
            self._proc = self._conn = None
