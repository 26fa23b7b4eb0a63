"""Where a node reads tenant policies (sampling rate, opt-out, TTL, share cap).

``PolicySource.get(tenant_id)`` never raises and never blocks long: the HTTP source
caches answers for ``ttl_s``, keeps serving the last good answer when the control plane
is unreachable, and falls back to the defaults for tenants it has never seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from adaflash.config import GovernanceConfig
from adaflash.contracts.tenancy import TenantPolicy

log = logging.getLogger(__name__)


def default_policy(tenant_id: str, gov: GovernanceConfig | None = None) -> TenantPolicy:
    g = gov or GovernanceConfig()
    return TenantPolicy(tenant_id=tenant_id, sampling_rate=g.default_sampling_rate, opt_out=False,
                        ttl_days=g.default_ttl_days, share_cap=g.default_share_cap)


@runtime_checkable
class PolicySource(Protocol):
    def get(self, tenant_id: str) -> TenantPolicy: ...


class StaticPolicySource:
    """Policies held in memory (tests, single-node set-ups, config files)."""

    def __init__(self, policies: Mapping[str, TenantPolicy] | None = None, gov: GovernanceConfig | None = None):
        self._gov = gov or GovernanceConfig()
        self._policies: dict[str, TenantPolicy] = dict(policies or {})
        self._lock = threading.Lock()

    def set(self, policy: TenantPolicy) -> None:
        with self._lock:
            self._policies[policy.tenant_id] = policy

    def get(self, tenant_id: str) -> TenantPolicy:
        with self._lock:
            p = self._policies.get(tenant_id)
        return p if p is not None else default_policy(tenant_id, self._gov)

    def all(self) -> list[TenantPolicy]:
        with self._lock:
            return list(self._policies.values())


class HttpPolicySource:
    """``GET {base_url}/api/v1/tenants/{tenant_id}/policy`` -> TenantPolicy JSON, cached.

    404: the tenant has no policy of its own, so the defaults (cached like an answer).
    Unreachable or invalid answer: the last good policy if any, else the defaults; the
    next try waits ``retry_s`` so a down control plane costs one timeout per tenant per
    ``retry_s`` at most.
    """

    def __init__(self, base_url: str, *, ttl_s: float = 30.0, timeout_s: float = 1.0, retry_s: float = 5.0,
                 token: str | None = None, gov: GovernanceConfig | None = None, client=None):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._gov = gov or GovernanceConfig()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self._cache: dict[str, tuple[TenantPolicy, float]] = {}  # tenant -> (policy, expires monotonic)
        self._lock = threading.Lock()
        self.counters = {"fetches": 0, "errors": 0, "fallbacks": 0}

    def get(self, tenant_id: str) -> TenantPolicy:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(tenant_id)
        if hit and hit[1] > now:
            return hit[0]
        policy = self._fetch(tenant_id)
        with self._lock:
            if policy is not None:
                self._cache[tenant_id] = (policy, now + self.ttl_s)
                return policy
            self.counters["fallbacks"] += 1
            fallback = hit[0] if hit else default_policy(tenant_id, self._gov)
            self._cache[tenant_id] = (fallback, now + self.retry_s)
            return fallback

    def _fetch(self, tenant_id: str) -> TenantPolicy | None:
        from urllib.parse import quote

        self.counters["fetches"] += 1
        url = f"{self.base_url}/api/v1/tenants/{quote(tenant_id, safe='')}/policy"
        try:
            r = self._client.get(url)
            if r.status_code == 404:
                return default_policy(tenant_id, self._gov)
            r.raise_for_status()
            p = TenantPolicy.model_validate(r.json())
            if p.tenant_id != tenant_id:
                raise ValueError("policy for another tenant")
            return p
        except Exception as e:  # noqa: BLE001 - any failure: fall back
            self.counters["errors"] += 1
            log.warning("tenant policy unavailable (%s); using cached or default policy", type(e).__name__)
            return None

    def invalidate(self, tenant_id: str | None = None) -> None:
        with self._lock:
            if tenant_id is None:
                self._cache.clear()
            else:
                self._cache.pop(tenant_id, None)

    def close(self) -> None:
        self._client.close()
