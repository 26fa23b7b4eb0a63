"""The control plane's background work, beside the admin API.

Two loops, so that a long shadow evaluation never delays a rollback:

- rollout loop (every controlplane.worker_interval_s): discovery of new registry
  versions, the TTL reaper, the deletion pass (the control plane's part of any request
  not done yet, completion), one rollout reconciliation pass (pushes to nodes, MLflow
  mirrors);
- shadow loop (every controlplane.shadow_interval_s, and woken by discovery):
  shadow evaluation of every registered version, then its gates.

Everything they do is persisted in the database first; both loops are safe to kill
at any point and to restart (``ShadowEvaluator.recover`` puts an interrupted
evaluation back in the queue; the reconciler resumes the promotion's current step).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from controlplane import deletion, discovery, hold, lifecycle
from controlplane.db import session_scope
from controlplane.gates import GatePolicy
from controlplane.registry import Registry
from controlplane.rollout import NodePusher, RolloutReconciler, node_admin_token
from controlplane.shadow import FeedbackWindow, ShadowEvaluator

log = logging.getLogger("adaflash.controlplane.worker")


def reap(sessions: sessionmaker[Session], registry: Registry | None = None) -> list[str]:
    """Expire candidates older than their TTL (and mirror their state to MLflow)."""
    with session_scope(sessions) as s:
        expired = lifecycle.expire_candidates(s)
    if expired and registry is not None:
        try:
            for v in expired:
                registry.set_state(v, "expired")
        except Exception as e:
            log.warning("could not mirror expired states to MLflow: %s", e)
    return expired


class Workers:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session], policy: GatePolicy, *,
                 registry: Registry | None = None, window: FeedbackWindow | None = None,
                 evaluator: ShadowEvaluator | None = None, reconciler: RolloutReconciler | None = None,
                 pusher: NodePusher | None = None):
        self.settings, self.sessions, self.policy = settings, sessions, policy
        self.registry = registry or Registry.from_settings(settings)
        self.evaluator = evaluator or ShadowEvaluator(settings, sessions, self.registry, policy, window)
        if pusher is None and reconciler is None:
            token = node_admin_token(settings)
            pusher = NodePusher(token, settings.controlplane.push_timeout_s) if token else None
        self.reconciler = reconciler or RolloutReconciler(sessions, policy, settings, registry=self.registry,
                                                          pusher=pusher)
        self._stop = threading.Event()
        self._wake_shadow = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors = 0

    # -- single passes (tests call these directly) --
    def discover(self) -> list[str]:
        with session_scope(self.sessions) as s:
            found = discovery.sync_versions(s, self.registry, self.policy)
        if found:
            log.info("discovered versions %s", ", ".join(d.version for d in found))
            self._wake_shadow.set()
        return [d.version for d in found]

    def rollout_pass(self) -> str | None:
        self.discover()
        reap(self.sessions, self.registry)
        try:
            deletion.reconcile(self.sessions, self.settings)
        except Exception:  # never in the way of a rollout; retried next pass
            self.errors += 1
            log.exception("deletion pass failed")
        return self.reconciler.run_once()

    def shadow_pass(self):
        """Evaluate the registered versions, unless an admin holds evaluation (controlplane/hold.py)."""
        with session_scope(self.sessions) as s:
            if hold.evaluation_held(s):
                return []
        return self.evaluator.run_once()

    # -- loops --
    def _loop(self, name: str, fn, interval: float, wake: threading.Event | None = None) -> None:
        while not self._stop.is_set():
            try:
                fn()
            except Exception:  # keep the loop alive; the next pass retries from the database
                self.errors += 1
                log.exception("%s pass failed", name)
            if wake is not None:
                wake.wait(interval)
                wake.clear()
            else:
                self._stop.wait(interval)

    def start(self) -> Workers:
        self.evaluator.recover()
        cp = self.settings.controlplane
        self._threads = [
            threading.Thread(target=self._loop, args=("rollout", self.rollout_pass, cp.worker_interval_s),
                             name="adaflash-cp-rollout", daemon=True),
            threading.Thread(target=self._loop, args=("shadow", self.shadow_pass, cp.shadow_interval_s,
                                                      self._wake_shadow),
                             name="adaflash-cp-shadow", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake_shadow.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
        if self.reconciler.pusher is not None:
            self.reconciler.pusher.close()
