"""Tenant-fair admission: per-tenant quotas at the door, weighted fair queuing inside.

Two parts, both per tenant:

- ``TenantAdmission`` guards the door. A request is counted against its tenant from the
  moment it is queued until it finishes: queued requests (``max_queued``) and tokens in
  flight (prompt + max_tokens of queued and running requests, ``max_tokens``). Over
  either, ``acquire`` raises ``TenantOverQuota`` and the server answers HTTP 429 with
  Retry-After. Limits and weight come from the tenant's policy where it sets them, from
  ``DataplaneConfig.tenant_*`` otherwise; policies are read off the request path (a
  cache refreshed on a background thread), so a slow control plane never delays a request.
- ``FairQueue`` holds the waiting requests, one FIFO per tenant, and hands them to the
  scheduler in start-time fair queuing order: on arrival a request gets the start tag
  S = max(V, F_tenant) and its tenant's finish tag becomes F_tenant = S + cost / weight
  (cost = prompt + max_tokens); the waiting head with the smallest S goes next and the
  virtual time V becomes its S. A tenant that queued a thousand requests has its tags
  far in the future, so a newcomer's first request is next in line: its wait is its
  fair share of the node, whatever the flood.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Gauge

from adaflash.config import DataplaneConfig
from adaflash.contracts.serving import error_body
from dataplane.sequence import Sequence

log = logging.getLogger("adaflash.admission")

POLICY_TTL_S = 30.0  # how long a tenant's limits are trusted before a background refresh


@dataclass(frozen=True)
class TenantLimits:
    weight: float
    max_queued: int  # requests waiting for admission; 0: no limit
    max_tokens: int  # prompt + max_tokens of queued and running requests; 0: no limit


class TenantOverQuota(Exception):
    """A tenant asked for more than its queue limit or token budget allows."""

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.tenant, self.reason, self.message, self.retry_after_s = tenant, reason, message, retry_after_s


def request_cost(seq: Sequence) -> int:
    """Tokens a request may occupy: its prompt and its whole answer."""
    return len(seq.prompt_ids) + seq.params.max_tokens


class FairQueue:
    """Waiting requests, one FIFO per tenant, popped in start-time fair order (see module doc)."""

    def __init__(self, weight_of: Callable[[str], float] | None = None):
        self.weight_of = weight_of or (lambda _t: 1.0)
        self._queues: dict[str, deque[tuple[float, Sequence]]] = {}
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last queued request
        self.vtime = 0.0
        self._len = 0

    def append(self, seq: Sequence) -> None:
        tenant = seq.tenant_id
        start = max(self.vtime, self._finish.get(tenant, 0.0))
        weight = max(1e-6, float(self.weight_of(tenant)))
        self._finish[tenant] = start + request_cost(seq) / weight
        self._queues.setdefault(tenant, deque()).append((start, seq))
        self._len += 1

    def _head_tenant(self) -> str | None:
        best, best_key = None, None
        for tenant, q in self._queues.items():
            key = (q[0][0], q[0][1].arrival)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best

    def peek(self) -> Sequence:
        tenant = self._head_tenant()
        if tenant is None:
            raise IndexError("peek from an empty FairQueue")
        return self._queues[tenant][0][1]

    def popleft(self) -> Sequence:
        tenant = self._head_tenant()
        if tenant is None:
            raise IndexError("pop from an empty FairQueue")
        q = self._queues[tenant]
        start, seq = q.popleft()
        self.vtime = max(self.vtime, start)
        if not q:
            del self._queues[tenant]
        self._len -= 1
        self._forget_idle()
        return seq

    def _forget_idle(self) -> None:
        """Tenants with nothing queued whose tags are behind V carry no state (bounded memory)."""
        for tenant in [t for t, f in self._finish.items() if f <= self.vtime and t not in self._queues]:
            del self._finish[tenant]

    def remove_if(self, pred: Callable[[Sequence], bool]) -> list[Sequence]:
        gone: list[Sequence] = []
        for tenant in list(self._queues):
            q = self._queues[tenant]
            keep = deque(item for item in q if not pred(item[1]))
            gone.extend(item[1] for item in q if pred(item[1]))
            if keep:
                self._queues[tenant] = keep
            else:
                del self._queues[tenant]
        self._len -= len(gone)
        return gone

    def depth_by_tenant(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._queues.items()}

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for q in self._queues.values():
            for _s, seq in q:
                yield seq


class AdmissionMetrics:
    def __init__(self, registry):
        self.depth = Gauge("adaflash_tenant_queue_depth", "Requests of a tenant waiting for admission",
                           ["tenant"], registry=registry)
        self.admitted = Counter("adaflash_tenant_admitted", "Requests of a tenant admitted into the running set",
                                ["tenant"], registry=registry)
        self.rejected = Counter("adaflash_tenant_rejected", "Requests of a tenant refused with 429",
                                ["tenant", "reason"], registry=registry)


class TenantAdmission:
    """Per-tenant accounting of queued requests and tokens in flight (thread-safe)."""

    def __init__(self, cfg: DataplaneConfig, registry, policy=None, tps: Callable[[], float] | None = None):
        self.cfg = cfg
        self.policy = policy  # anything with .get(tenant) -> TenantPolicy; None: config defaults
        self.metrics = AdmissionMetrics(registry)
        self._tps = tps or (lambda: 0.0)
        self._lock = threading.Lock()
        self._queued: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._held: dict[int, tuple[str, int, bool]] = {}  # id(seq) -> (tenant, cost, still queued)
        self._limits: dict[str, tuple[TenantLimits, float]] = {}  # tenant -> (limits, refresh after)
        self._refreshing: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None

    # --- limits -------------------------------------------------------------------------------------
    def defaults(self) -> TenantLimits:
        c = self.cfg
        return TenantLimits(c.tenant_weight, c.tenant_max_queued, c.tenant_max_tokens)

    def limits(self, tenant: str) -> TenantLimits:
        """Cached limits of a tenant (config defaults until its policy has been read)."""
        with self._lock:
            hit = self._limits.get(tenant)
            stale = hit is None or hit[1] <= time.monotonic()
            if self.policy is not None and stale and tenant not in self._refreshing:
                self._refreshing.add(tenant)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="adaflash-admission-policy")
                self._pool.submit(self._refresh, tenant)
        return hit[0] if hit else self.defaults()

    def _refresh(self, tenant: str) -> None:
        try:
            self.set_limits(tenant, self.from_policy(self.policy.get(tenant)))
        except Exception as e:  # noqa: BLE001 - keep what we had; the defaults otherwise
            log.warning("tenant policy for admission unavailable: %s", type(e).__name__)
        finally:
            with self._lock:
                self._refreshing.discard(tenant)

    def from_policy(self, p) -> TenantLimits:
        d = self.defaults()
        return TenantLimits(
            weight=p.weight if getattr(p, "weight", None) is not None else d.weight,
            max_queued=p.max_queued if getattr(p, "max_queued", None) is not None else d.max_queued,
            max_tokens=p.max_tokens if getattr(p, "max_tokens", None) is not None else d.max_tokens)

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Limits of a tenant: refreshed from the policy after POLICY_TTL_S, kept for good without one."""
        with self._lock:
            self._limits[tenant] = (limits, time.monotonic() + POLICY_TTL_S)

    def weight(self, tenant: str) -> float:
        return self.limits(tenant).weight

    # --- accounting ---------------------------------------------------------------------------------
    def acquire(self, seq: Sequence) -> None:
        """Count a new request against its tenant, or raise TenantOverQuota."""
        tenant, cost = seq.tenant_id, request_cost(seq)
        lim = self.limits(tenant)
        with self._lock:
            queued, tokens = self._queued.get(tenant, 0), self._tokens.get(tenant, 0)
            if lim.max_queued and queued >= lim.max_queued:
                err = TenantOverQuota(tenant, "tenant_queue_full",
                                      f"tenant {tenant} has {queued} requests queued, its limit is {lim.max_queued}",
                                      self._retry_after(tokens))
            elif lim.max_tokens and tokens + cost > lim.max_tokens:
                err = TenantOverQuota(tenant, "tenant_token_budget",
                                      f"tenant {tenant} has {tokens} tokens in flight; this request needs {cost} "
                                      f"more and its budget is {lim.max_tokens}", self._retry_after(tokens))
            else:
                self._queued[tenant], self._tokens[tenant] = queued + 1, tokens + cost
                self._held[id(seq)] = (tenant, cost, True)
                self.metrics.depth.labels(tenant=tenant).set(queued + 1)
                return
        self.metrics.rejected.labels(tenant=tenant, reason=err.reason).inc()
        raise err

    def _retry_after(self, tokens: int) -> int:
        """Seconds until the tenant's tokens in flight would drain at the node's recent rate."""
        tps = self._tps()
        est = tokens / tps if tps > 0 else self.cfg.tenant_retry_after_s
        return int(min(self.cfg.tenant_retry_after_max_s, max(1, math.ceil(est))))

    def on_admitted(self, seq: Sequence) -> None:
        """The scheduler moved the request into the running set."""
        with self._lock:
            held = self._held.get(id(seq))
            if held is None or not held[2]:
                return
            tenant, cost, _ = held
            self._held[id(seq)] = (tenant, cost, False)
            self._dec_queued(tenant)
        self.metrics.admitted.labels(tenant=tenant).inc()

    def release(self, seq: Sequence) -> None:
        """The request finished (any reason): its tokens leave the tenant's budget."""
        with self._lock:
            held = self._held.pop(id(seq), None)
            if held is None:
                return
            tenant, cost, queued = held
            if queued:
                self._dec_queued(tenant)
            left = self._tokens.get(tenant, 0) - cost
            if left > 0:
                self._tokens[tenant] = left
            else:
                self._tokens.pop(tenant, None)

    def _dec_queued(self, tenant: str) -> None:
        n = self._queued.get(tenant, 0) - 1
        if n > 0:
            self._queued[tenant] = n
        else:
            self._queued.pop(tenant, None)
        self.metrics.depth.labels(tenant=tenant).set(max(0, n))

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            tenants = set(self._queued) | set(self._tokens)
            return {t: {"queued": self._queued.get(t, 0), "tokens": self._tokens.get(t, 0)} for t in tenants}

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def install_quota_errors(app: FastAPI, metrics=None) -> None:
    """Answer TenantOverQuota with HTTP 429, Retry-After and an OpenAI-shaped error."""

    @app.exception_handler(TenantOverQuota)
    async def _over_quota(_req, e: TenantOverQuota):
        if metrics is not None:
            metrics.rejected.labels(reason=e.reason).inc()
        return JSONResponse(error_body(e.message, type_="rate_limit_error", param=None, code=e.reason),
                            status_code=429, headers={"Retry-After": str(e.retry_after_s)})
