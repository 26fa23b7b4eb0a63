"""The learner's side of record claims (controlplane/claims.py): before a step, claim the
records about to be trained; records another learner trained are finished here as
``trained_elsewhere``, records another learner holds under a live claim wait and are claimed
again later; after the checkpoint, before offsets are committed, the trained ones are reported.

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
        self.counters = {"granted": 0, "trained_elsewhere": 0, "held_elsewhere": 0, "unavailable": 0}
        self.last_error: str | None = None

    def claim(self, record_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """Claim ``record_ids``; returns (trained by another learner: never train them,
        held by another learner: not now)."""
        report = self.unreported[:REPORT_BATCH]
        try:
            out = self.client.claim_records(self.learner_id, record_ids, report)
        except Exception as e:  # noqa: BLE001 - control plane away: train, report later
            self.counters["unavailable"] += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("record claims unavailable (%s); %d records go unclaimed", self.last_error,
                        len(record_ids))
            return set(), set()
        self.unreported, self.last_error = self.unreported[len(report):], None
        self.counters["granted"] += len(out.granted)
        self.counters["trained_elsewhere"] += len(out.trained_elsewhere)
        self.counters["held_elsewhere"] += len(out.held_elsewhere)
        if out.trained_elsewhere or out.held_elsewhere:
            log.info("records of other learners: %d trained (not trained here), %d held (claimed again later)",
                     len(out.trained_elsewhere), len(out.held_elsewhere))
        return set(out.trained_elsewhere), set(out.held_elsewhere)

    def sort(self, items: Sequence) -> tuple[list, list, list]:
        """Claim the buffer items ``items``: (to train, trained by another learner, held by one)."""
        trained, held = self.claim([i.record.record_id for i in items])
        return ([i for i in items if i.record.record_id not in trained | held],
                [i for i in items if i.record.record_id in trained], [i for i in items if i.record.record_id in held])

    def trained(self, record_ids: Sequence[str]) -> None:
        """Checkpointed as trained: reported now (the claims become final), or with the next
        call if the control plane is away."""
        self.unreported = (self.unreported + list(record_ids))[-MAX_UNREPORTED:]
        self.flush()

    def flush(self) -> None:
        """Report what is trained; what the control plane does not take waits."""
        while self.unreported:
            before = len(self.unreported)
            self.claim([])
            if len(self.unreported) >= before:
                return
