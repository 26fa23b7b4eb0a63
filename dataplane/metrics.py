"""Prometheus metrics of one serving node (a registry per engine, so tests stay isolated)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_BLOCK = 64


class NodeMetrics:
    def __init__(self, block_size: int = 16):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("adaflash_requests", "Finished requests", ["tenant", "finish_reason"], registry=r)
        self.rejected = Counter("adaflash_requests_rejected", "Requests refused with a 4xx", ["reason"], registry=r)
        self.tokens = Counter("adaflash_generated_tokens", "Generated tokens", registry=r)
        self.rounds = Counter("adaflash_spec_rounds", "Speculative rounds (verify passes per request)", registry=r)
        self.verified = Counter("adaflash_verified_tokens", "Tokens verified by the target", registry=r)
        self.accepted = Counter("adaflash_accepted_tokens", "Draft tokens accepted", registry=r)
        self.tau = Histogram("adaflash_tau", "Tokens committed per round", buckets=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17],
                             registry=r)
        self.k_hat = Histogram("adaflash_k_hat", "Verified length per round",
                               buckets=[1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 32, 64], registry=r)
        self.pos_verified = Counter("adaflash_position_verified", "Draft tokens verified at block position",
                                    ["position"], registry=r)
        self.pos_accepted = Counter("adaflash_position_accepted", "Draft tokens accepted at block position",
                                    ["position"], registry=r)
        self.queue_depth = Gauge("adaflash_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("adaflash_running", "Requests in the running set", registry=r)
        self.n_hat = Gauge("adaflash_admission_n_hat", "EMA of requests advanced per step", registry=r)
        self.tps = Gauge("adaflash_tps", "Generated tokens per second (last 10 s)", registry=r)
        self.tau_live = Gauge("adaflash_tau_live", "Mean tokens per round (last 10 s)", registry=r)
        self.drafter = Gauge("adaflash_drafter_info", "Served drafter version", ["version"], registry=r)
        self.swaps = Counter("adaflash_drafter_swaps", "Drafter hot-reloads", ["result"], registry=r)
        self.swap_pause = Histogram("adaflash_drafter_swap_pause_seconds", "Serving pause at a drafter swap",
                                    buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1], registry=r)
        self.errors = Counter("adaflash_engine_errors", "Engine step errors", registry=r)
        self.step_s = Histogram("adaflash_step_seconds", "Engine step time", registry=r)
        self._lock = threading.Lock()
        self._window: deque[tuple[float, int, int]] = deque()  # (time, tokens, rounds)
        self._drafter_version: str | None = None

    def set_drafter(self, version: str | None) -> None:
        """A new drafter serves: the live window restarts, so the live tau and TPS that the
        control plane judges a canary by never mix in rounds of the previous version."""
        if self._drafter_version is not None:
            self.drafter.remove(self._drafter_version)
        if version != self._drafter_version:
            with self._lock:
                self._window.clear()
        self._drafter_version = version
        if version is not None:
            self.drafter.labels(version=version).set(1)

    def on_round(self, k_hat: int, accepted: int, committed: int) -> None:
        self.rounds.inc()
        self.verified.inc(k_hat)
        self.accepted.inc(accepted)
        self.tau.observe(committed)
        self.k_hat.observe(k_hat)
        for i in range(1, min(k_hat, MAX_BLOCK)):
            self.pos_verified.labels(position=str(i)).inc()
            if i <= accepted:
                self.pos_accepted.labels(position=str(i)).inc()

    def on_tokens(self, n: int, rounds: int = 0) -> None:
        self.tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n, rounds))
            while self._window and now - self._window[0][0] > 10.0:
                self._window.popleft()

    def live(self) -> dict:
        now = time.monotonic()
        with self._lock:
            while self._window and now - self._window[0][0] > 10.0:
                self._window.popleft()
            toks = sum(n for _, n, _ in self._window)
            rounds = sum(r for _, _, r in self._window)
            span = max(1.0, now - self._window[0][0]) if self._window else 10.0
        return {"tps": toks / span, "tau": toks / rounds if rounds else 0.0}

    def render(self) -> bytes:
        live = self.live()
        self.tps.set(live["tps"])
        self.tau_live.set(live["tau"])
        return generate_latest(self.registry)
