"""Judging a canary under the load it actually has, not against a fixed number.

Tokens per second move with load (more requests in flight: more tokens per second per
node, each request slower), and tau moves with the traffic mix. So a rollout compares
like with like:

- baseline nodes: while some nodes still serve the outgoing version, the canaries' mean
  tau and TPS are divided by the mean of those nodes over the same window (heartbeats
  sent after the step began). TPS is compared only when the two groups carry a similar
  load (mean requests in flight within ``max_load_difference`` of each other); tau always.
- a node's own baseline: where no node serves the outgoing version (a single node, or the
  fleet during roll-out and after completion), each judged node is compared with its own
  *load profile* recorded before the promotion: an exponential average of tau and TPS per
  load bucket (buckets of requests in flight, on a log scale) from its heartbeats while it
  served the outgoing version. A node whose current load falls in a bucket it has no
  baseline for (nor a neighbouring one) is not judged on TPS; its tau is compared with
  its tau at the closest load it was seen at (else the fleet's tau before the promotion).

The error rate is judged as before (``rollout.judge``): absolute, against the policy's
ceiling or the baseline's own rate, whichever is higher.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from controlplane.gates import EPS, RolloutPolicy
from controlplane.models import Node

PROFILE_ALPHA = 0.3  # weight of the newest heartbeat in a load bucket's average
ANY_LOAD = "any"  # bucket of heartbeats that carry no load (older nodes)


def load_bucket(load: float | None) -> str:
    """Requests in flight -> bucket: 0, 1, 2-3, 4-7, ... as half-octaves of (1 + load)."""
    if load is None:
        return ANY_LOAD
    return str(int(round(2 * math.log2(1.0 + max(0.0, load)))))


def update_profile(node: Node) -> None:
    """Fold the node's latest heartbeat into its load profile for the version it serves."""
    if not node.live_tps or not node.live_tau:
        return  # an idle node says nothing about its speed
    prof = dict(node.load_profile or {})
    if prof.get("version") != node.served_version:
        prof = {"version": node.served_version, "buckets": {}}
    buckets = dict(prof.get("buckets") or {})
    key = load_bucket(node.live_load)
    old = buckets.get(key)
    if old is None:
        buckets[key] = {"tps": node.live_tps, "tau": node.live_tau, "n": 1}
    else:
        a = PROFILE_ALPHA
        buckets[key] = {"tps": (1 - a) * old["tps"] + a * node.live_tps,
                        "tau": (1 - a) * old["tau"] + a * node.live_tau, "n": old["n"] + 1}
    prof["buckets"] = buckets
    node.load_profile = prof


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _busy(nodes: Iterable[Node]) -> list[Node]:
    return [n for n in nodes if (n.live_tps or 0) > 0 and (n.live_tau or 0) > 0]


def _similar(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is None and b is None  # neither reports load: assume the balancer splits evenly
    return abs(a - b) <= tolerance * max(a, b, 1.0) + EPS


def against_nodes(judged: list[Node], baseline: list[Node], policy: RolloutPolicy) -> dict[str, Any]:
    """Ratios of the judged nodes' means to the baseline nodes' over the same window."""
    j, b = _busy(judged), _busy(baseline)
    if not j or not b:
        return {}
    out: dict[str, Any] = {"against": "baseline_nodes", "baseline_nodes": sorted(n.node_id for n in b)}
    out["tau"] = _mean([n.live_tau for n in j]) / _mean([n.live_tau for n in b])
    lj = _mean([n.live_load for n in j if n.live_load is not None])
    lb = _mean([n.live_load for n in b if n.live_load is not None])
    if _similar(lj, lb, policy.max_load_difference):
        out["tps"] = _mean([n.live_tps for n in j]) / _mean([n.live_tps for n in b])
    out["load"] = (lj, lb)
    return out


def _profile_at(profile: dict | None, load: float | None) -> dict | None:
    buckets = (profile or {}).get("buckets") or {}
    key = load_bucket(load)
    if key in buckets:
        return buckets[key]
    if key != ANY_LOAD:
        for near in (str(int(key) - 1), str(int(key) + 1)):
            if near in buckets:
                return buckets[near]
    return None


def _closest(profile: dict | None, load: float | None) -> dict | None:
    buckets = {k: v for k, v in ((profile or {}).get("buckets") or {}).items() if k != ANY_LOAD}
    if not buckets:
        return ((profile or {}).get("buckets") or {}).get(ANY_LOAD)
    want = int(load_bucket(load)) if load is not None else 0
    return buckets[min(buckets, key=lambda k: abs(int(k) - want))]


def against_profiles(judged: list[Node], baseline: dict) -> dict[str, Any]:
    """Mean over judged nodes of their TPS divided by their own pre-promotion TPS at a similar
    load, and of their tau divided by their own tau at the closest load they were seen at
    (tau hardly moves with load; the fleet's tau before the promotion when a node has no
    profile)."""
    profiles = baseline.get("profiles") or {}
    tau, tps = [], []
    for n in _busy(judged):
        near = _profile_at(profiles.get(n.node_id), n.live_load)
        closest = near or _closest(profiles.get(n.node_id), n.live_load)
        tau_ref = closest["tau"] if closest else baseline.get("tau")
        if tau_ref:
            tau.append(n.live_tau / tau_ref)
        if near:
            tps.append(n.live_tps / near["tps"])
    return {"against": "own_baseline", "tau": _mean(tau), "tps": _mean(tps)} if tau or tps else {}


def judge_relative(judged: list[Node], baseline_nodes: list[Node], baseline: dict | None,
                   policy: RolloutPolicy) -> str | None:
    """Why the judged nodes regress against the baseline nodes (else their own profiles), or None."""
    ratios = against_nodes(judged, baseline_nodes, policy) or against_profiles(judged, baseline or {})
    reasons = []
    for key, limit in (("tau", policy.max_live_tau_regression), ("tps", policy.max_live_tps_regression)):
        r = ratios.get(key)
        if r is not None and 1.0 - r > limit + EPS:
            reasons.append(f"live {key} {r:.3f}x of the {ratios['against'].replace('_', ' ')} at the same load "
                           f"(at most -{limit:.1%} allowed)")
    return "; ".join(reasons) or None
