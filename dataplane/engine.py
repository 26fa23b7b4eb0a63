"""The engine loop: continuous batching over the target, drafter and scheduler.

Requests arrive from any thread (``add``) and join between steps; each step admits and
prefills new requests, advances the selected running requests by one speculative round
(``SpecStep``), commits tokens, applies stop conditions and retires finished requests.
Drafter hot-reloads are applied between steps. Everything model-related runs on the
engine thread; callers get tokens through the ``on_update`` callback of the request
envelope they add with each sequence (``dataplane.envelope``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from adaflash.config import DataplaneConfig
from dataplane.admission import TenantAdmission
from dataplane.cost_model import CostModel
from dataplane.drafter import Drafter
from dataplane.envelope import RequestEnvelope
from dataplane.grammar import GrammarState
from dataplane.metrics import NodeMetrics
from dataplane.model import TargetModel
from dataplane.sampling import first_token, token_logprobs
from dataplane.scheduler import Scheduler
from dataplane.sequence import Sequence, Status
from dataplane.spec_policy import PolicyConfig
from dataplane.spec_step import SpecStep

log = logging.getLogger("adaflash.engine")


class Engine:
    def __init__(self, target: TargetModel, cfg: DataplaneConfig, drafter: Drafter | None = None,
                 drafter_version: str | None = None, eos_token_ids: list[int] | None = None,
                 max_model_len: int = 2048, metrics: NodeMetrics | None = None):
        self.target = target
        self.target.batch_invariant = cfg.batch_invariant
        self.cfg = cfg
        self.mode = cfg.mode
        self.drafter = drafter
        self.drafter_version = drafter_version if drafter is not None else None
        self.eos = set(eos_token_ids if eos_token_ids is not None else target.args.eos_token_ids)
        self.max_model_len = max_model_len
        self.metrics = metrics or NodeMetrics(cfg.block_size)
        self.metrics.set_drafter(self.drafter_version)
        self.cost = CostModel()
        self.cost.set_products(getattr(target, "product_curve", None) or [])  # measured by TargetModel.warm_up
        self.step_runner = SpecStep(target, PolicyConfig.of(cfg), self.cost)
        self.admission = TenantAdmission(cfg, self.metrics.registry, tps=lambda: self.metrics.live()["tps"])
        self.scheduler = Scheduler(cfg.max_running, cfg.max_verify_tokens, cfg.max_prefill_tokens, cfg.ema_beta,
                                   weight_of=self.admission.weight)
        # Feedback hook, called with each finished sequence and its envelope; it must only hand
        # them on (the record is built on another thread, dataplane.feedback).
        self.on_finish: Callable[[Sequence, RequestEnvelope | None], None] | None = None
        self._envelopes: dict[int, RequestEnvelope] = {}  # id(sequence) -> its envelope, until it finishes
        self._inbox: queue.Queue = queue.Queue()
        self._cancel: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._swap: tuple[Drafter | None, str | None, Future] | None = None
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.steps = 0
        self.finished_count = 0
        self.error_count = 0
        self.last_error: str | None = None

    # --- called from any thread ----------------------------------------------------------------
    def add(self, seq: Sequence, envelope: RequestEnvelope | None = None) -> None:
        """Queue a request; raises ``TenantOverQuota`` when its tenant is over its limits."""
        self.admission.acquire(seq)
        if envelope is not None:
            self._envelopes[id(seq)] = envelope
        self._inbox.put(seq)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        with self._cancel_lock:
            self._cancel.add(request_id)
        self._wake.set()

    def swap_drafter(self, drafter: Drafter | None, version: str | None) -> Future:
        """Ask for a drafter swap between steps; the future resolves to the pause in seconds."""
        fut: Future = Future()
        with self._swap_lock:
            if self._swap is not None:
                self._swap[2].set_exception(RuntimeError("superseded by a newer drafter load"))
            self._swap = (drafter, version, fut)
        self._wake.set()
        if self._thread is None:
            self._apply_swap()
        return fut

    @property
    def load(self) -> dict:
        return {"waiting": self.scheduler.depth + self._inbox.qsize(), "running": len(self.scheduler.running)}

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()  # a stopped engine can start again
            self._thread = threading.Thread(target=self._loop, name="adaflash-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.admission.close()

    # --- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.step()
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def step(self) -> bool:
        """One scheduling step. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        self._apply_swap()
        self._drain_inbox()
        self._apply_cancellations()
        if not self.scheduler.waiting and not self.scheduler.running:
            return False
        admitted: list[Sequence] = []
        try:
            admitted = self.scheduler.admit()
            for s in admitted:
                self.admission.on_admitted(s)
            if admitted:
                self._prefill(admitted)
            running = [s for s in self.scheduler.running if s.status == Status.RUNNING]
            if running:
                self._decode()
            self.steps += 1
        except Exception as e:  # a bad step must not take the node down: fail its requests
            log.exception("engine step failed")
            self.metrics.errors.inc()
            self.last_error = f"{type(e).__name__}: {e}"
            for s in list(self.scheduler.running) + [a for a in admitted if a.status != Status.FINISHED]:
                self._finish(s, "error", error=self.last_error)  # a failed prefill's requests too
            self.scheduler.remove_finished()
        self._retire()
        self.metrics.queue_depth.set(self.scheduler.depth)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.n_hat.set(self.scheduler.n_hat)
        self.metrics.step_s.observe(time.perf_counter() - t0)
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the engine on the calling thread until every request finished (tests, benches)."""
        for _ in range(max_steps):
            if not self.step() and self._inbox.empty():
                return

    def _drain_inbox(self) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            self.scheduler.add(seq)

    def _apply_cancellations(self) -> None:
        with self._cancel_lock:
            ids, self._cancel = self._cancel, set()
        if not ids:
            return
        for s in self.scheduler.drop(lambda s: s.request_id in ids or s.cancelled):
            self._finish(s, "cancelled")

    def _apply_swap(self) -> None:
        with self._swap_lock:
            pending, self._swap = self._swap, None
        if pending is None:
            return
        drafter, version, fut = pending
        t0 = time.perf_counter()
        self.drafter, self.drafter_version = drafter, version
        self.step_runner.reset_calibration()
        # In-flight requests hold context caches of the old drafter: they finish without
        # drafting (their drafter_version no longer matches); new requests use the new one.
        pause = time.perf_counter() - t0
        self.metrics.set_drafter(version)
        self.metrics.swap_pause.observe(pause)
        fut.set_result(pause)

    # --- prefill -------------------------------------------------------------------------------
    def _hidden_layers(self) -> tuple[int, ...]:
        if self.mode == "ar" or self.drafter is None:
            return ()
        return tuple(self.drafter.config.target_layers)

    def _prefill(self, seqs: list[Sequence]) -> None:
        cu, ids = [0], []
        now = time.monotonic()
        for s in seqs:
            s.prefill_at = now
            cap = len(s.prompt_ids) + s.params.max_tokens + self.cfg.block_size + 1
            s.target_kv = self.target.new_cache(capacity=min(cap, self.max_model_len + self.cfg.block_size))
            if self.drafter is not None and self.mode != "ar":
                s.drafter_kv = self.drafter.new_cache(capacity=min(cap, self.max_model_len + self.cfg.block_size))
                s.drafter_version = self.drafter_version
            if s.params.temperature > 0 and s.generator is None:
                s.generator = torch.Generator()
                s.generator.manual_seed(s.params.seed if s.params.seed is not None
                                        else int(torch.randint(0, 2**62, (1,))))
            if s.params.grammar is not None and s.grammar_state is None:
                s.grammar_state = GrammarState(s.params.grammar, self.target.args.vocab_size,
                                               self.cfg.block_size + 1, self.eos)
        # Sequences with the same prompt (the n choices of a request) share one prefill:
        # the first computes it, the others copy its keys and values.
        first_of: dict[tuple[int, ...], int] = {}
        owner = [first_of.setdefault(tuple(s.prompt_ids), len(first_of)) for s in seqs]
        unique = [next(s for s, o in zip(seqs, owner, strict=True) if o == u) for u in range(len(first_of))]
        for s in unique:
            ids.extend(s.prompt_ids)
            cu.append(len(ids))
        layers = self._hidden_layers()
        last = torch.tensor(cu[1:], dtype=torch.int64) - 1
        out = self.target.forward_packed(torch.tensor(ids, dtype=torch.int64), cu, [s.target_kv for s in unique],
                                         logits_index=last, hidden_layers=layers)
        for s, u in zip(seqs, owner, strict=True):
            src = unique[u].target_kv
            if s.target_kv is not src:
                s.target_kv.reserve(src.length)
                s.target_kv.data[:, :, :, : src.length] = src.data[:, :, :, : src.length]
                s.target_kv.length = src.length
            if layers:
                s.context_pending.append(out.hidden[cu[u] : cu[u + 1]])
            tok = first_token(s, out.logits[u])
            self._commit(s, [tok], self._logprobs(s, out.logits[u : u + 1], [tok]))
        self.scheduler.start_running(seqs)

    # --- decode --------------------------------------------------------------------------------
    def _decode(self) -> None:
        runner = self.step_runner
        candidates = [s for s in self.scheduler.running if s.status == Status.RUNNING]
        # The policy reserves each request's verify tokens before the drafter runs; the
        # scheduler picks the batch from them, and only the chosen requests draft.
        reserved = runner.reserve(candidates, self.drafter, self.drafter_version, self.max_model_len)
        sizes = {id(s): r for s, r in zip(candidates, reserved, strict=True)}
        chosen = [s for s in self.scheduler.select(sizes) if id(s) in sizes]
        plan = runner.plan(chosen, [sizes[id(s)] for s in chosen], self.drafter)
        old_len = [s.target_kv.length for s in plan.seqs]
        layers = self._hidden_layers()
        result, hidden, cu = runner.run(plan, layers)
        for b, s in enumerate(plan.seqs):
            a = result.accepted[b]
            s.target_kv.truncate(old_len[b] + a + 1)
            a = self._accepted_before_eos(s, result.committed[b], a)
            s.draft_s += plan.draft_s / len(plan.seqs)
            s.verify_s += result.verify_s / len(plan.seqs)
            runner.record_round(s, plan.k_hat[b], a, plan.a_hat[b], len(plan.seqs))
            if hidden is not None and s.drafter_kv is not None and s.drafter_version == self.drafter_version:
                s.context_pending.append(hidden[cu[b] : cu[b] + a + 1])
            rows = result.logits[cu[b] : cu[b] + len(result.committed[b])]
            n = self._commit(s, result.committed[b], self._logprobs(s, rows, result.committed[b]))
            self.metrics.on_round(plan.k_hat[b], a, n)
        self.scheduler.record_step(len(plan.seqs))

    def _accepted_before_eos(self, s: Sequence, tokens: list[int], accepted: int) -> int:
        """Drafts accepted up to the end of the sequence: drafts after an accepted EOS (a
        finished grammar drafts nothing else) are never emitted, so they do not count."""
        if s.params.ignore_eos:
            return accepted
        return next((min(accepted, i) for i, t in enumerate(tokens) if t in self.eos), accepted)

    # --- commit and finish -----------------------------------------------------------------------
    @staticmethod
    def _logprobs(s: Sequence, rows: torch.Tensor, tokens: list[int]) -> list | None:
        """Target logprobs of tokens about to be committed (rows [m, V] raw logits), if asked."""
        if s.params.logprobs is None:
            return None
        return token_logprobs(rows, tokens, s.params.logprobs)

    def _commit(self, s: Sequence, tokens: list[int], logprobs: list | None = None) -> int:
        """Append tokens up to the first stop condition; returns how many were appended."""
        now = time.monotonic()
        added: list[int] = []
        reason = None
        for t in tokens:
            s.output_ids.append(t)
            added.append(t)
            if t in self.eos and not s.params.ignore_eos:
                reason = "stop"
                break
            if len(s.output_ids) >= s.params.max_tokens:
                reason = "length"
                break
            if s.num_tokens >= self.max_model_len:
                reason = "length"
                break
        if logprobs is not None:
            s.logprobs.extend(logprobs[: len(added)])
        if s.grammar_state is not None:
            s.grammar_state.advance(added)
        if s.first_token_at is None:
            s.first_token_at = now
        s.token_times.extend([now] * len(added))
        self.metrics.on_tokens(len(added), 1)
        env = self._envelopes.get(id(s))
        if reason is not None:  # finished (status, reason) before the client hears of it: the HTTP
            self._finish(s, reason)  # side reads seq.finish_reason as soon as the update arrives
        if env is not None and env.on_update is not None:
            try:
                env.on_update(s, added, reason is not None)
            except Exception:  # a broken client callback must not stop the engine
                log.exception("on_update failed")
                s.cancelled = True
        if reason is None and s.cancelled:
            self._finish(s, "cancelled")
        return len(added)

    def _finish(self, s: Sequence, reason: str, error: str | None = None) -> None:
        if s.status == Status.FINISHED:
            return
        s.status = Status.FINISHED
        s.finish_reason = s.finish_reason if (reason == "cancelled" and s.finish_reason) else reason
        s.error = error
        s.finished_at = time.monotonic()
        self.admission.release(s)
        self.finished_count += 1
        self.error_count += reason == "error"
        self.metrics.requests.labels(tenant=s.tenant_id, finish_reason=s.finish_reason).inc()
        env = self._envelopes.pop(id(s), None)
        if reason in ("error", "cancelled") and env is not None and env.on_update is not None:
            try:
                env.on_update(s, [], True)
            except Exception:
                log.exception("on_update failed")
        if self.on_finish is not None and reason != "error":
            try:
                self.on_finish(s, env)
            except Exception:  # feedback must never take serving down
                log.exception("feedback hook failed")

    def _retire(self) -> None:
        for s in self.scheduler.remove_finished():
            s.target_kv = None
            s.drafter_kv = None
