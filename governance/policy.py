"""Where a node reads tenant policies (sampling rate, opt-out, TTL, share cap).

Fail closed: ``PolicySource.get(tenant_id)`` returns ``None`` when the tenant's policy is
not known, and the emitter then holds the tenant's records (bounded) or drops them,
never emits them under a default. ``get`` never raises and never blocks long.

- ``StaticPolicySource``: policies held in memory; with no control plane configured the
  node's own configuration is the authority, so a tenant it does not list gets the
  configured defaults (``governance.default_*``).
- ``HttpPolicySource``: the control plane is the authority. Its answers are cached for
  ``ttl_s`` and the last good one is kept while the control plane cannot be reached; a
  tenant it has never answered for (unreachable, token refused, malformed answer, 404)
  has no policy: ``None``, asked again after ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from adaflash.config import GovernanceConfig
from adaflash.contracts.tenancy import TenantPolicy

if TYPE_CHECKING:
    from adaflash.controlplane_client import ControlPlaneClient

log = logging.getLogger(__name__)


def default_policy(tenant_id: str, gov: GovernanceConfig | None = None) -> TenantPolicy:
    """The configured defaults (a standalone node's answer for a tenant it does not list)."""
    g = gov or GovernanceConfig()
    return TenantPolicy(tenant_id=tenant_id, sampling_rate=g.default_sampling_rate, opt_out=False,
                        ttl_days=g.default_ttl_days, share_cap=g.default_share_cap)


@runtime_checkable
class PolicySource(Protocol):
    def get(self, tenant_id: str) -> TenantPolicy | None: ...


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
    """``GET {base_url}/api/v1/tenants/{tenant_id}/policy`` (the typed control-plane client) -> TenantPolicy, cached.

    The control plane answers every tenant (its defaults for one nobody configured), so
    anything but a valid policy of the asked tenant is a failure: the last good policy
    if there is one, else ``None``. After a failure the tenant is not asked again for
    ``retry_s``, so a down control plane costs one timeout per tenant per ``retry_s``.
    """

    def __init__(self, base_url: str, *, ttl_s: float = 30.0, timeout_s: float = 1.0, retry_s: float = 5.0,
                 token: str | None = None, client: ControlPlaneClient | None = None):
        from adaflash.controlplane_client import ControlPlaneClient

        self.base_url = base_url.rstrip("/")
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._client = client or ControlPlaneClient(self.base_url, token or "", timeout_s=timeout_s)
        self._cache: dict[str, tuple[TenantPolicy, float]] = {}  # tenant -> (policy, expires monotonic)
        self._unknown_until: dict[str, float] = {}  # tenant with no policy -> next try (monotonic)
        self._lock = threading.Lock()
        self.counters = {"fetches": 0, "errors": 0, "stale": 0, "unknown": 0}

    def get(self, tenant_id: str) -> TenantPolicy | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(tenant_id)
            if hit and hit[1] > now:
                return hit[0]
            if hit is None and self._unknown_until.get(tenant_id, 0.0) > now:
                self.counters["unknown"] += 1
                return None
        policy = self._fetch(tenant_id)
        with self._lock:
            if policy is not None:
                self._cache[tenant_id] = (policy, now + self.ttl_s)
                self._unknown_until.pop(tenant_id, None)
                return policy
            if hit is not None:  # keep the last good answer; ask again after retry_s
                self.counters["stale"] += 1
                self._cache[tenant_id] = (hit[0], now + self.retry_s)
                return hit[0]
            self.counters["unknown"] += 1
            self._unknown_until[tenant_id] = now + self.retry_s
            return None

    def _fetch(self, tenant_id: str) -> TenantPolicy | None:
        self.counters["fetches"] += 1
        try:
            p = self._client.get_tenant_policy(tenant_id)
            if p.tenant_id != tenant_id:
                raise ValueError("policy for another tenant")
            return p
        except Exception as e:  # noqa: BLE001 - any failure: no answer
            self.counters["errors"] += 1
            log.warning("tenant policy unavailable (%s)", type(e).__name__)
            return None

    def invalidate(self, tenant_id: str | None = None) -> None:
        with self._lock:
            if tenant_id is None:
                self._cache.clear()
                self._unknown_until.clear()
            else:
                self._cache.pop(tenant_id, None)
                self._unknown_until.pop(tenant_id, None)

    def close(self) -> None:
        self._client.close()
