"""The learner's side of record claims (controlplane/claims.py): before a step, claim the
records about to be trained; records another learner trained or holds are finished here as
``trained_elsewhere``; after the checkpoint, the trained ones are reported with the next call.

The control plane out of reach: the step trains what it took (each learner still
de-duplicates against its own ledger; only records handed between learners by a broker that
came back empty could then be trained twice), and the trained ids wait to be reported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from adaflash.controlplane_client import ControlPlaneClient

log = logging.getLogger("adaflash.learner.claims")

MAX_UNREPORTED = 100_000  # trained ids kept for the next report while the control plane is away
REPORT_BATCH = 10_000  # trained ids reported per call (ClaimsIn's bound)


class RecordClaims:
    """Shares the learner's control-plane client (learner/deletion.py's), on the learner's thread."""

    def __init__(self, client: ControlPlaneClient, learner_id: str):
        self.client, self.learner_id = client, learner_id
        self.unreported: list[str] = []
        self.counters = {"granted": 0, "trained_elsewhere": 0, "unavailable": 0}
        self.last_error: str | None = None

    def claim(self, record_ids: Sequence[str]) -> set[str]:
        """Claim ``record_ids``; returns those another learner holds or trained (not to train)."""
        report = self.unreported[:REPORT_BATCH]
        try:
            out = self.client.claim_records(self.learner_id, record_ids, report)
        except Exception as e:  # noqa: BLE001 - control plane away: train, report later
            self.counters["unavailable"] += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("record claims unavailable (%s); training %d records unclaimed", self.last_error,
                        len(record_ids))
            return set()
        self.unreported, self.last_error = self.unreported[len(report):], None
        elsewhere = set(out.held_elsewhere)
        self.counters["granted"] += len(out.granted)
        self.counters["trained_elsewhere"] += len(elsewhere)
        if elsewhere:
            log.info("%d records held or trained by another learner: not trained here (%s)", len(elsewhere),
                     sorted(set(out.held_elsewhere.values())))
        return elsewhere

    def trained(self, record_ids: Sequence[str]) -> None:
        """Checkpointed as trained: reported with the next claim (or ``flush``)."""
        self.unreported = (self.unreported + list(record_ids))[-MAX_UNREPORTED:]

    def flush(self) -> None:
        """Report what is trained (at close); what the control plane does not take waits."""
        while self.unreported:
            before = len(self.unreported)
            self.claim([])
            if len(self.unreported) >= before:
                return
