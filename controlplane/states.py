"""State machines of the control plane: a version's lifecycle and a promotion's rollout.

Pure data: which states exist and which transitions are legal. The functions that
persist a transition (and audit it) live in ``controlplane.lifecycle``.
"""

from __future__ import annotations

from enum import StrEnum

from adaflash.contracts.admin_api import DeletionScope, DeletionState, NodeRole, Role  # noqa: F401


class VersionState(StrEnum):
    registered = "registered"  # discovered in the registry, manifest read
    evaluating = "evaluating"  # shadow evaluation running
    gate_failed = "gate_failed"
    awaiting_approval = "awaiting_approval"
    approved = "approved"  # a promotion row exists for it
    canary = "canary"  # served by the canary nodes
    champion = "champion"  # served by every node
    retired = "retired"  # a former champion (the newest one is the `previous` alias)
    rejected = "rejected"  # by a person, with a reason
    expired = "expired"  # older than the candidate TTL before it was promoted
    rolled_back = "rolled_back"  # taken out of service after promotion


V = VersionState
VERSION_TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    V.registered: frozenset({V.evaluating, V.rejected, V.expired}),
    # evaluating -> registered: an evaluation that crashed is retried from scratch.
    V.evaluating: frozenset({V.gate_failed, V.awaiting_approval, V.registered, V.rejected, V.expired}),
    V.gate_failed: frozenset({V.rejected, V.expired}),
    V.awaiting_approval: frozenset({V.approved, V.rejected, V.expired}),
    V.approved: frozenset({V.canary, V.rejected, V.expired}),
    V.canary: frozenset({V.champion, V.rolled_back}),
    V.champion: frozenset({V.retired, V.rolled_back}),
    V.retired: frozenset({V.champion}),  # an operator rollback reinstates the previous champion
    V.rejected: frozenset(),
    V.expired: frozenset(),
    V.rolled_back: frozenset(),
}

# A candidate that has not reached a node yet: the TTL reaper may expire it.
PRE_SERVING_STATES = frozenset({V.registered, V.evaluating, V.gate_failed, V.awaiting_approval, V.approved})
# Versions a node may be pinned to: they passed their gates and were approved once.
PINNABLE_STATES = frozenset({V.approved, V.canary, V.champion, V.retired})


class PromotionKind(StrEnum):
    promote = "promote"  # candidate -> canary -> champion
    rollback = "rollback"  # champion -> previous


class PromotionState(StrEnum):
    """Rollout steps. Each is persisted before the reconciler acts on it, so a restarted
    control plane re-enters the step it was in and repeats it (every step is idempotent:
    it sets desired versions and waits for heartbeats to converge)."""

    pending = "pending"  # queued; nothing acted yet
    canary = "canary"  # desired version set on the canary nodes, waiting for them to serve it
    watching = "watching"  # canaries serve it; live metrics watched until watch_until
    rolling_out = "rolling_out"  # desired version set on every node
    rolling_back = "rolling_back"  # desired version set back to from_version everywhere
    completed = "completed"
    rolled_back = "rolled_back"
    aborted = "aborted"  # cancelled before it acted (candidate rejected or expired)


P = PromotionState
PROMOTION_TRANSITIONS: dict[PromotionState, frozenset[PromotionState]] = {
    P.pending: frozenset({P.canary, P.rolling_out, P.rolling_back, P.aborted}),
    P.canary: frozenset({P.watching, P.rolling_back}),
    P.watching: frozenset({P.rolling_out, P.rolling_back}),
    P.rolling_out: frozenset({P.completed, P.rolling_back}),
    P.rolling_back: frozenset({P.rolled_back, P.completed}),
    P.completed: frozenset(),
    P.rolled_back: frozenset(),
    P.aborted: frozenset(),
}
ACTIVE_PROMOTION_STATES = frozenset({P.pending, P.canary, P.watching, P.rolling_out, P.rolling_back})


class DeletionComponent(StrEnum):
    """Who acknowledges a deletion request: each one purges the stores it owns."""

    controlplane = "controlplane"  # evaluation reports and plots, the JSONL evaluation window
    node = "node"  # emitter and producer queues, spool, usage-audit samples (one ack per node)
    learner = "learner"  # replay buffer, deferred records, checkpoint ledger (one ack per learner)


def can_transition(table: dict, old, new) -> bool:
    return new in table.get(old, frozenset())
