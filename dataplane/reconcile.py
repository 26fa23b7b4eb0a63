"""Level-triggered reconciliation with the control plane.

Every interval the node heartbeats its served version, live tau / TPS / error rate and
its measured cost curve (dataplane/cost_model.py);
the answer carries the version the control plane wants it to serve. If they differ the
node loads the desired one (same checks as POST /admin/drafter). A restarted node or
control plane converges without replaying events: only the current desired state matters.

Deletion requests too: after each heartbeat the node asks for the open deletion requests
it has not acknowledged (``GET /api/v1/deletion-requests?instance=<node id>``), purges
the tenant from every store it holds (``FeedbackEmitter.purge_stores``: emitter and
producer queues, spool, usage-audit samples) and acknowledges with what it purged. A
store that failed is retried next interval; nothing is acknowledged until all purged.
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import UTC

from pydantic import ValidationError

from adaflash import credentials
from adaflash.contracts.admin_api import DeletionAckIn, HeartbeatIn
from adaflash.controlplane_client import ControlPlaneClient, ControlPlaneError
from dataplane.drafter_io import DrafterLoadError
from dataplane.node import Node

log = logging.getLogger("adaflash.reconcile")


class Reconciler:
    def __init__(self, node: Node, base_url: str, token: str, public_url: str, interval_s: float = 5.0):
        self.node = node
        self.base = base_url.rstrip("/")
        self.public_url = public_url
        self.interval = interval_s
        self.cp = ControlPlaneClient(base_url, token, timeout_s=10.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed_versions: dict[str, str] = {}  # version -> reason, so a bad one is not retried forever
        self.last_error: str | None = None

    @classmethod
    def from_settings(cls, node: Node, public_url: str) -> Reconciler | None:
        cfg = node.settings.dataplane
        if not cfg.controlplane_url:
            return None
        token = credentials.lookup(credentials.node_controlplane(node.settings)) or ""
        return cls(node, cfg.controlplane_url, token, public_url, cfg.reconcile_interval_s)

    def tick(self) -> dict | None:
        """One heartbeat + convergence step; returns the desired state seen (or None)."""
        try:
            answer = self.cp.heartbeat(self.node.node_id, self.beat())
        except (ControlPlaneError, ValidationError) as e:
            self.last_error = f"control plane unreachable: {e}"
            return None
        desired = answer.desired.model_dump() if answer.desired is not None else None
        self.last_error = None
        try:
            self.deletions()
        except Exception as e:  # noqa: BLE001 - retried next tick; serving and convergence go on
            log.warning("deletion requests: %s: %s", type(e).__name__, e)
        if desired and desired.get("version") and desired["version"] != self.node.engine.drafter_version:
            v = desired["version"]
            if v in self.failed_versions and self.failed_versions[v] == desired.get("sha256"):
                return desired
            try:
                self.node.load_drafter(v, desired["uri"], desired.get("sha256"))
                log.info("now serving drafter %s", v)
            except DrafterLoadError as e:
                self.failed_versions[v] = desired.get("sha256")
                log.warning("desired drafter %s refused: %s", v, e)
        return desired

    def beat(self) -> HeartbeatIn:
        """What the node reports: served version, live figures, load, status and cost curve."""
        st = self.node.live_status()
        err = self.node.last_load_error
        return HeartbeatIn.model_validate({
            "served_version": st["version"], "url": self.public_url, "live_tau": st["tau"], "live_tps": st["tps"],
            "error_rate": st["error_rate"], "live_load": float(st.get("running", 0) + st.get("waiting", 0)),
            "status": "degraded" if err else "ready",
            "message": re.sub(r"[\x00-\x1f\x7f]", " ", err)[:2000] if err else None,  # one printable line
            "cost_curve": st.get("cost_curve")})

    def deletions(self) -> list[dict]:
        """Execute the deletion requests awaiting this node; returns the acknowledgements sent."""
        sent = []
        for req in self.cp.deletion_work(self.node.node_id):
            before = req.created_at if req.created_at.tzinfo else req.created_at.replace(tzinfo=UTC)
            emitter = getattr(self.node, "emitter", None)
            if emitter is not None:
                report = emitter.purge_stores(req.tenant_id, before)
                if report.failed:
                    log.error("deletion %s: stores %s failed; retried", req.id, sorted(report.failed))
                    continue
                purged, detail = report.purged, {}
            else:
                purged, detail = {}, {"feedback": "disabled on this node"}
            ack = DeletionAckIn(component="node", instance=self.node.node_id, purged=purged, detail=detail)
            self.cp.ack_deletion(req.id, ack)
            log.info("deletion %s of tenant %s: purged %s", req.id, req.tenant_id, purged)
            sent.append(ack.model_dump(mode="json") | {"request_id": req.id})
        return sent

    def start(self) -> None:
        def loop():
            while not self._stop.is_set():
                try:
                    self.tick()
                except Exception:  # never let reconciliation take serving down
                    log.exception("reconcile tick failed")
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name="adaflash-reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self.cp.close()
