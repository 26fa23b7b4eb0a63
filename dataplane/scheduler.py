"""Who runs next: a waiting queue, the running set, EMA admission and a token budget.

Each step advances some running requests: their verify tokens (k_hat each) are packed
until the step's token budget is spent; requests that overflow wait for the next step
(at the head of the line). N_hat, an exponential moving average of how many requests a
step actually advanced (N_hat <- (1 - beta) N_hat + beta N), bounds how many requests
are admitted into the running set, so admission follows what the engine can really
advance rather than a fixed batch size. Waiting requests are served fairly across tenants
(``dataplane.admission.FairQueue``: weighted fair queuing), so one tenant's flood does not
hold another tenant's requests behind it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from dataplane.admission import FairQueue
from dataplane.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_running: int, max_verify_tokens: int, max_prefill_tokens: int,
                 ema_beta: float = 0.2, admit_step: int = 8, weight_of: Callable[[str], float] | None = None):
        self.max_running = max_running
        self.max_verify_tokens = max_verify_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.beta = ema_beta
        self.admit_step = admit_step
        self.n_hat = float(admit_step)
        self.waiting = FairQueue(weight_of)
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def admit_limit(self) -> int:
        """How many requests may be running: what a step advances, plus room to grow."""
        return min(self.max_running, max(1, math.floor(self.n_hat)) + self.admit_step)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running set within the prefill token budget."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.admit_limit:
            seq = self.waiting.peek()
            n = len(seq.prompt_ids)
            if admitted and n > budget:
                break
            self.waiting.popleft()
            budget -= n
            seq.status = Status.RUNNING
            admitted.append(seq)
        return admitted

    def start_running(self, seqs: list[Sequence]) -> None:
        self.running.extend(s for s in seqs if s.status == Status.RUNNING)

    def select(self, k_hat: dict[int, int] | None = None) -> list[Sequence]:
        """The running requests this step advances, in order, within the verify token budget.

        k_hat maps id(seq) -> verify tokens (1 when absent). Overflow stays in the running
        set and goes first next step.
        """
        chosen, used, rest = [], 0, deque()
        for seq in self.running:
            n = (k_hat or {}).get(id(seq), 1)
            if chosen and used + n > self.max_verify_tokens:
                rest.append(seq)
            else:
                chosen.append(seq)
                used += n
        self.running = deque(chosen) if not rest else rest + deque(chosen)
        return chosen

    def record_step(self, advanced: int) -> None:
        self.n_hat = (1 - self.beta) * self.n_hat + self.beta * advanced

    def remove_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.status == Status.FINISHED]
        if done:
            self.running = deque(s for s in self.running if s.status != Status.FINISHED)
        return done

    def drop(self, pred) -> list[Sequence]:
        """Remove waiting and running requests matching ``pred`` (cancellation)."""
        gone = self.waiting.remove_if(pred)
        stopped = [s for s in self.running if pred(s)]
        if stopped:
            ids = {id(s) for s in stopped}
            self.running = deque(s for s in self.running if id(s) not in ids)
        return gone + stopped

    @property
    def depth(self) -> int:
        return len(self.waiting)
