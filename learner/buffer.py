"""The replay buffer: the records one training step uses, under tenant policy.

- Share cap: no tenant holds more than ``max(1, floor(share_cap * capacity))`` records
  of one buffer (``share_cap`` from the tenant's policy, ``capacity`` = buffer_size).
  The cap is relative to the buffer's capacity, not to what happens to be in it, so a
  deployment with a single tenant still trains (on partial buffers, after max_wait_s)
  while a tenant can never supply more than its share of any candidate's data.
  Records over the cap are deferred to a later buffer, not dropped; fetching pauses
  while ``max_deferred`` records wait (``wants_more``).
- TTL: a record older than its tenant's ``ttl_days`` is never trained on; it is
  checked when offered and again when the buffer is taken. Expired and opted-out
  records are dropped (not sent to the DLQ, which would retain them longer).
- A record id already in the buffer is refused (the persisted de-duplication of
  trained ids lives in the checkpoint store).

Every item remembers its (partition, offset) so the consumer commits no offset past a
record that is still held.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from adaflash.contracts.feedback import FeedbackRecord, is_evaluation_record
from adaflash.contracts.tenancy import TenantPolicy
from learner.supervision import Tokenized

PolicySource = Callable[[str], TenantPolicy]


class StaticPolicies:
    """Tenant policies from a mapping, with defaults for unknown tenants."""

    def __init__(self, policies: dict[str, TenantPolicy] | None = None, ttl_days: float = 30.0,
                 share_cap: float = 0.5):
        self.policies = dict(policies or {})
        self.ttl_days, self.share_cap = ttl_days, share_cap

    def __call__(self, tenant_id: str) -> TenantPolicy:
        p = self.policies.get(tenant_id)
        if p is None:  # defaults; not validated: a record's tenant id need not fit the policy pattern
            p = TenantPolicy.model_construct(tenant_id=tenant_id, sampling_rate=1.0, opt_out=False,
                                             ttl_days=self.ttl_days, share_cap=self.share_cap)
        return p

    @classmethod
    def from_file(cls, path: str | Path, ttl_days: float = 30.0, share_cap: float = 0.5) -> StaticPolicies:
        """A YAML or JSON list of TenantPolicy objects."""
        raw = yaml.safe_load(Path(path).read_text()) if str(path).endswith((".yaml", ".yml")) \
            else json.loads(Path(path).read_text())
        items = [TenantPolicy.model_validate(x) for x in (raw or [])]
        return cls({p.tenant_id: p for p in items}, ttl_days=ttl_days, share_cap=share_cap)


@dataclass
class Item:
    tok: Tokenized
    partition: int
    offset: int
    arrived: float = field(default_factory=time.monotonic)
    traceparent: str | None = None  # the record's trace (Kafka header), linked from the train step
    epoch: int = 0  # the broker incarnation it was read from (learner/resilience.py)

    @property
    def record(self) -> FeedbackRecord:
        return self.tok.record


def expired(record: FeedbackRecord, policy: TenantPolicy, now: datetime) -> bool:
    return record.created_at + timedelta(days=policy.ttl_days) < now


DROPPED = ("expired", "opt_out", "stale")  # what a held record can be dropped for while it waits


class ReplayBuffer:
    def __init__(self, capacity: int, policy: PolicySource, max_wait_s: float = 60.0, max_deferred: int = 128,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 monotonic: Callable[[], float] = time.monotonic, max_age_s: float | None = None):
        self.capacity = capacity
        self.max_age_s = max_age_s  # older records are shed as "stale" (None: never)
        self.policy = policy
        self.max_wait_s = max_wait_s
        self.max_deferred = max_deferred
        self.clock, self.monotonic = clock, monotonic
        self.items: list[Item] = []
        self.deferred: deque[Item] = deque()
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # reason -> count (expired, opt_out, stale)

    # --- admission ------------------------------------------------------------------------------
    def cap(self, tenant_id: str) -> int:
        return max(1, int(self.policy(tenant_id).share_cap * self.capacity))

    def usable(self, record: FeedbackRecord) -> str | None:
        """None if the record may be trained on now, else why not ("held_out", "expired", "opt_out", "stale")."""
        if is_evaluation_record(record.record_id):  # reserved for shadow evaluation, never trained on
            return "held_out"
        p = self.policy(record.tenant_id)
        if p.opt_out:
            return "opt_out"
        if expired(record, p, self.clock()):
            return "expired"
        if self.stale(record):
            return "stale"
        return None

    def stale(self, record: FeedbackRecord) -> bool:
        """Created more than ``max_age_s`` ago: a learner this far behind its traffic sheds it."""
        return self.max_age_s is not None and record.created_at < self.clock() - timedelta(seconds=self.max_age_s)

    def shed_stale(self) -> list[Item]:
        """Remove the held records that grew stale while they waited; returns them (finished untrained)."""
        if self.max_age_s is None:
            return []
        out = [i for i in self.items + list(self.deferred) if self.stale(i.record)]
        if out:
            gone = {id(i) for i in out}
            self.items = [i for i in self.items if id(i) not in gone]
            self.deferred = deque(i for i in self.deferred if id(i) not in gone)
            self.counts = Counter(i.record.tenant_id for i in self.items)
            self.dropped["stale"] += len(out)
        return out

    def holds(self, record_id: str) -> bool:
        return any(i.record.record_id == record_id for i in self.items) or \
            any(i.record.record_id == record_id for i in self.deferred)

    def offer(self, item: Item) -> str:
        """Returns "buffered", "deferred", "duplicate" or a drop reason ("held_out", "expired", "opt_out", "stale")."""
        why = self.usable(item.record)
        if why:
            self.dropped[why] += 1
            return why
        if self.holds(item.record.record_id):
            return "duplicate"
        if len(self.items) < self.capacity and self.counts[item.record.tenant_id] < self.cap(item.record.tenant_id):
            self._add(item)
            return "buffered"
        self.deferred.append(item)
        return "deferred"

    def _add(self, item: Item) -> None:
        self.items.append(item)
        self.counts[item.record.tenant_id] += 1

    def wants_more(self) -> bool:
        return len(self.deferred) < self.max_deferred

    # --- taking a buffer --------------------------------------------------------------------------
    def ready(self) -> bool:
        if len(self.items) >= self.capacity:
            return True
        if not self.items:
            return False
        return self.monotonic() - min(i.arrived for i in self.items) >= self.max_wait_s

    def take(self) -> tuple[list[Item], list[Item]]:
        """Hand the current buffer to training; refill from the deferred records.

        Returns (items to train on, items dropped now because they expired, opted out or grew
        stale while they waited). Both are done with once the step that took them is checkpointed.
        """
        train, gone = [], []
        for it in self.items:
            why = self.usable(it.record)
            if why:
                self.dropped[why] += 1
                gone.append(it)
            else:
                train.append(it)
        self.items, self.counts = [], Counter()
        waiting, self.deferred = self.deferred, deque()
        for it in waiting:
            outcome = self.offer(it)
            if outcome in DROPPED:
                gone.append(it)
        return train, gone

    def held(self) -> list[Item]:
        return self.items + list(self.deferred)

    def purge_tenant(self, tenant_id: str) -> tuple[int, int]:
        """Forget the tenant's records (a deletion request); returns (buffered, deferred) removed."""
        before = len(self.items), len(self.deferred)
        self.items = [i for i in self.items if i.record.tenant_id != tenant_id]
        self.deferred = deque(i for i in self.deferred if i.record.tenant_id != tenant_id)
        self.counts = Counter(i.record.tenant_id for i in self.items)
        return before[0] - len(self.items), before[1] - len(self.deferred)

    def drop_partitions(self, partitions: set[int], epoch: int | None = None) -> list[Item]:
        """Forget records of partitions this learner no longer owns (another will re-read them).

        With ``epoch``, only records read in that epoch (older ones cannot be read again).
        Returns the records forgotten."""
        def gone(i: Item) -> bool:
            return i.partition in partitions and (epoch is None or i.epoch == epoch)

        dropped = [i for i in self.held() if gone(i)]
        self.items = [i for i in self.items if not gone(i)]
        self.deferred = deque(i for i in self.deferred if not gone(i))
        self.counts = Counter(i.record.tenant_id for i in self.items)
        return dropped
