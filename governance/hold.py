"""Records waiting for their tenant's policy (fail closed).

A node that cannot learn a tenant's policy (control plane unreachable, token refused,
malformed answer) must not emit that tenant's feedback under a default. The emitter
parks such records here, raw and in memory only (never spooled, never logged), bounded
in count and age; once the policy is known they are emitted or dropped according to it,
and whatever is refused for room or waits too long is dropped and counted
(reason ``no_policy``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

from adaflash.contracts.feedback import FeedbackRecord

Item = tuple[FeedbackRecord, "str | None", float]  # record, traceparent, held since (monotonic)


class HeldRecords:
    """Per-tenant FIFO lists of records, at most ``max_records`` in all, each kept ``max_age_s``."""

    def __init__(self, max_records: int, max_age_s: float):
        self.max_records = max(0, int(max_records))
        self.max_age_s = max_age_s
        self._by_tenant: OrderedDict[str, list[Item]] = OrderedDict()
        self._n = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def add(self, record: FeedbackRecord, traceparent: str | None) -> bool:
        """Park a record; False when there is no room (the caller drops and counts it)."""
        with self._lock:
            if self._n >= self.max_records:
                return False
            self._by_tenant.setdefault(record.tenant_id, []).append((record, traceparent, time.monotonic()))
            self._n += 1
            return True

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._by_tenant)

    def take(self, tenant_id: str) -> list[tuple[FeedbackRecord, str | None]]:
        """Remove and return the tenant's records, oldest first."""
        with self._lock:
            items = self._by_tenant.pop(tenant_id, [])
            self._n -= len(items)
        return [(r, tp) for r, tp, _ in items]

    def expire(self, now: float | None = None) -> Counter[str]:
        """Remove records held longer than ``max_age_s``; returns how many per tenant."""
        now = time.monotonic() if now is None else now
        out: Counter[str] = Counter()
        with self._lock:
            for tenant in list(self._by_tenant):
                items = self._by_tenant[tenant]
                keep = [it for it in items if now - it[2] <= self.max_age_s]
                if len(keep) != len(items):
                    out[tenant] = len(items) - len(keep)
                    self._n -= len(items) - len(keep)
                    if keep:
                        self._by_tenant[tenant] = keep
                    else:
                        del self._by_tenant[tenant]
        return out

    def clear(self) -> Counter[str]:
        """Remove everything; returns how many per tenant."""
        with self._lock:
            out = Counter({t: len(items) for t, items in self._by_tenant.items()})
            self._by_tenant.clear()
            self._n = 0
        return out
