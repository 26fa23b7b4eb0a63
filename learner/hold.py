"""The learner's part of the fleet's learning hold (controlplane/hold.py).

Every ``learner.hold_poll_s`` the learner reads the hold between two steps
(``GET /api/v1/learners/{id}/hold``); while ``learning`` is held it takes no step. It
keeps consuming into its buffer (fetching pauses once the buffer is full, as always), so
nothing is lost for the hold. When the control plane cannot be reached, the last state
read stands; the records' claims need the control plane anyway before any step.
"""

from __future__ import annotations

import logging
import time

from adaflash.controlplane_client import ControlPlaneClient

log = logging.getLogger("adaflash.learner.hold")


class HoldWatch:
    def __init__(self, client: ControlPlaneClient, learner_id: str, interval_s: float = 2.0):
        self.client, self.learner_id, self.interval = client, learner_id, interval_s
        self.held = False
        self.reason: str | None = None
        self.last_error: str | None = None
        self._next = 0.0

    def tick(self) -> bool:
        h = self.client.learner_hold(self.learner_id)
        if h.learning != self.held:
            log.info("learning %s%s", "held" if h.learning else "resumed", f" ({h.reason})" if h.reason else "")
        self.held, self.reason = h.learning, h.reason
        return self.held

    def maybe_tick(self) -> bool:
        """Called between steps: read the hold every interval; returns whether learning is held."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            try:
                self.tick()
                self.last_error = None
            except Exception as e:  # noqa: BLE001 - control plane away: the last state read stands
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("learning hold: %s", self.last_error)
        return self.held
