"""The learner's part of deletion requests: poll the control plane, purge, acknowledge.

Level-triggered like the nodes' reconciler: every ``learner.deletion_poll_s`` the
learner asks for the open requests it has not acknowledged
(``GET /api/v1/deletion-requests?instance=<learner_id>``), purges the tenant
(``Learner.purge_tenant``: replay buffer, deferred records, records finished but not
checkpointed, ledger and de-duplication ids) and acknowledges with the counts. A
learner restarted mid-way asks again and finds the same work; purging twice is harmless.

The acknowledgement's detail says whether the learner's current weights were trained
on the tenant's records: they were if its ledger held any of them (every later step
starts from those weights), so the candidates it publishes from now on descend from
them. The control plane lists the published ones (lineage) as trained-in candidates.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC

from adaflash import credentials
from adaflash.contracts.admin_api import DeletionAckIn
from adaflash.controlplane_client import ControlPlaneClient

log = logging.getLogger("adaflash.learner.deletion")


class DeletionPoller:
    def __init__(self, learner, base_url: str, token: str, learner_id: str, interval_s: float = 10.0,
                 client: ControlPlaneClient | None = None):
        self.learner = learner
        self.learner_id = learner_id
        self.interval = interval_s
        self.client = client or ControlPlaneClient(base_url, token, timeout_s=10.0)
        self._next = 0.0
        self.last_error: str | None = None

    @classmethod
    def from_settings(cls, learner) -> DeletionPoller | None:
        cfg = learner.settings.learner
        if not cfg.controlplane_url:
            return None
        token = credentials.lookup(credentials.learner_controlplane(learner.settings)) or ""
        return cls(learner, cfg.controlplane_url, token, cfg.learner_id, cfg.deletion_poll_s)

    def tick(self) -> list[dict]:
        """Execute every open request awaiting this learner; returns the acknowledgements sent."""
        sent = []
        for req in self.client.deletion_work(self.learner_id):
            before = req.created_at if req.created_at.tzinfo else req.created_at.replace(tzinfo=UTC)
            purged, detail = self.learner.purge_tenant(req.tenant_id, before)
            ack = DeletionAckIn(component="learner", instance=self.learner_id, purged=purged, detail=detail)
            self.client.ack_deletion(req.id, ack)
            log.info("deletion %s of tenant %s: purged %s", req.id, req.tenant_id, purged)
            sent.append(ack.model_dump(mode="json") | {"request_id": req.id})
        return sent

    def maybe_tick(self) -> None:
        """Called from the learner's loop: a tick every interval; errors are logged and retried."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            self.tick()
            self.last_error = None
        except Exception as e:  # noqa: BLE001 - control plane away: training goes on, retried
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("deletion requests: %s", self.last_error)

    def close(self) -> None:
        self.client.close()
