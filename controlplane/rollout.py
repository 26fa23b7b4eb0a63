"""The rollout reconciler: carries promotions out, one persisted step at a time.

Desired state lives in the database (each node's desired version, the promotion rows,
the aliases); nodes converge on it by heartbeat (level-triggered) and, to be quicker,
by a direct push to their POST /admin/drafter. Each tick the reconciler reads the
active promotion, takes its lease, and does what its state calls for:

    pending       record the live baseline (tau / TPS / error rate of the fleet on the
                  outgoing champion); choose the canaries (nodes with role canary,
                  else ceil(canary_fraction * live nodes), at least one) -> canary.
                  A fleet with no node at all is promoted straight away.
    canary        wait until the live canaries serve the candidate -> watching
                  (their heartbeat counts are recorded).
    watching      judge the canaries' live metrics against the baseline; once the
                  window has passed and every converged canary sent
                  min_watch_heartbeats heartbeats inside it -> rolling_out.
    rolling_out   every node gets the candidate; judged likewise; when the live
                  nodes serve it -> completed (candidate champion, old one previous).
    rolling_back  desired versions point back; when the nodes serve them -> rolled_back
                  (or completed, for an operator rollback).
    completed     for post_promotion_watch_s the fleet is still judged; a regression
                  rolls back to `previous` (one call: ``lifecycle.rollback``).

A live regression (tau or TPS below the baseline by more than the policy allows, or
an error rate above max(max_live_error_rate, baseline)), a node refusing the
candidate, or a step not converged within converge_timeout_s rolls the promotion back
by itself. The baseline is relative and load-aware (controlplane/canary_judge.py): the
nodes still serving the outgoing version over the same window, under a similar load,
else each node's own tau / TPS at the same load before the promotion; never a fixed
TPS. Only nodes with traffic (TPS > 0) and a heartbeat sent after they began
serving the candidate are judged. Nodes silent for heartbeat_timeout_s do not hold a
step up unless the policy says wait_for_stale_nodes; their desired version is set all
the same and they converge when they come back.

Every state change is committed before anything is pushed to a node, so a control
plane killed at any point resumes from the database: the step it was in is repeated
(each is idempotent). A lease on the promotion row keeps two control planes from
driving one rollout; a lease left by a dead one expires after rollout_lease_s.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from adaflash import credentials
from adaflash.config import Settings
from adaflash.contracts import ALIAS_CHAMPION, ALIAS_PREVIOUS
from adaflash.telemetry import CONTROLPLANE, SpanAttrs, Spans, tracer
from controlplane import audit, canary_judge, discovery, fleet, lifecycle
from controlplane.db import session_scope, utcnow
from controlplane.errors import Conflict
from controlplane.gates import EPS, GatePolicy, RolloutPolicy
from controlplane.models import Node, Promotion, Version
from controlplane.registry import Registry
from controlplane.states import NodeRole, PromotionKind, PromotionState, VersionState

log = logging.getLogger("adaflash.controlplane.rollout")
_tracer = tracer(__name__, service=CONTROLPLANE)

SYSTEM_ROLLOUT = "system:rollout"
P = PromotionState


# -- live metrics -------------------------------------------------------------------------------------------------
def live_metrics(nodes: Iterable[Node]) -> dict[str, Any]:
    """Mean tau and TPS over nodes with traffic, worst error rate, and who was counted."""
    busy = [n for n in nodes if (n.live_tps or 0) > 0 and (n.live_tau or 0) > 0]
    errs = [n.error_rate for n in nodes if n.error_rate is not None]
    return {"tau": sum(n.live_tau for n in busy) / len(busy) if busy else None,
            "tps": sum(n.live_tps for n in busy) / len(busy) if busy else None,
            "error_rate": max(errs) if errs else None,
            "nodes": sorted(n.node_id for n in busy)}


def judge(current: dict[str, Any], baseline: dict[str, Any] | None, policy: RolloutPolicy) -> str | None:
    """Why the live metrics are a regression, or None."""
    base = baseline or {}
    reasons = []
    err, base_err = current.get("error_rate"), base.get("error_rate") or 0.0
    if err is not None and err > max(policy.max_live_error_rate, base_err) + EPS:
        reasons.append(f"error rate {err:.4f} above {max(policy.max_live_error_rate, base_err):.4f}")
    for key, limit in (("tau", policy.max_live_tau_regression), ("tps", policy.max_live_tps_regression)):
        cur, ref = current.get(key), base.get(key)
        if cur is None or not ref:
            continue
        drop = (ref - cur) / ref
        if drop > limit + EPS:
            reasons.append(f"live {key} {cur:.3f} vs baseline {ref:.3f} ({-drop:+.1%}, at most "
                           f"-{limit:.1%} allowed)")
    return "; ".join(reasons) or None


# -- pushing desired versions to nodes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PushResult:
    node_id: str
    version: str
    ok: bool
    refused: bool  # the node checked the artifact and said no (HTTP 409)
    pause_ms: float | None
    seconds: float
    error: str | None = None


def node_admin_token(settings: Settings) -> str | None:
    """The nodes' admin bearer token: env var, configured file, then the embedded node's token file."""
    return credentials.lookup(credentials.nodes_admin(settings))


class NodePusher:
    """POST /admin/drafter to nodes in background threads; results are collected by ``drain``."""

    def __init__(self, token: str, timeout_s: float = 120.0, retry_s: float = 5.0, workers: int = 8):
        self.token, self.timeout_s, self.retry_s = token, timeout_s, retry_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adaflash-push")
        self._inflight: dict[str, tuple[str, Future]] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._done: list[PushResult] = []
        self._lock = threading.Lock()

    def push(self, node_id: str, url: str, version: str, uri: str, sha256: str | None) -> bool:
        now = time.monotonic()
        with self._lock:
            busy = self._inflight.get(node_id)
            if busy is not None and not busy[1].done():
                return False
            if now - self._last.get((node_id, version), -math.inf) < self.retry_s:
                return False
            self._last[(node_id, version)] = now
            fut = self.pool.submit(self._post, node_id, url, version, uri, sha256)
            self._inflight[node_id] = (version, fut)
            fut.add_done_callback(self._collect)
        return True

    def _post(self, node_id: str, url: str, version: str, uri: str, sha256: str | None) -> PushResult:
        t0 = time.perf_counter()
        try:
            r = httpx.post(f"{url.rstrip('/')}/admin/drafter", json={"version": version, "uri": uri, "sha256": sha256},
                           headers={"Authorization": f"Bearer {self.token}"},
                           timeout=httpx.Timeout(self.timeout_s, connect=3.0))
        except httpx.HTTPError as e:
            return PushResult(node_id, version, False, False, None, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        if r.status_code == 200:
            body = r.json()
            return PushResult(node_id, version, True, False, body.get("pause_ms"), dt)
        return PushResult(node_id, version, False, r.status_code == 409, None, dt, f"HTTP {r.status_code}: {r.text[:500]}")

    def _collect(self, fut: Future) -> None:
        try:
            res = fut.result()
        except Exception as e:  # a bug in _post must not kill the pool silently
            log.exception("push failed: %s", e)
            return
        with self._lock:
            self._done.append(res)

    def drain(self) -> list[PushResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(f.done() for _, f in self._inflight.values()):
                    return
            time.sleep(0.02)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# -- the reconciler ------------------------------------------------------------------------------------------------
class RolloutReconciler:
    def __init__(self, sessions: sessionmaker[Session], policy: GatePolicy, settings: Settings, *,
                 registry: Registry | None = None, pusher: NodePusher | None = None, owner: str | None = None,
                 clock: Callable[[], datetime] = utcnow):
        self.sessions, self.policy, self.settings = sessions, policy, settings
        self.registry, self.pusher, self.clock = registry, pusher, clock
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_s = settings.controlplane.rollout_lease_s
        self.heartbeat_timeout_s = settings.controlplane.heartbeat_timeout_s
        self.refusals: dict[tuple[str, str], str] = {}  # (node, version) -> why the node refused it
        self.pushes: list[PushResult] = []  # every push result, newest last (bounded)
        self._mirrored: Any = None

    @property
    def rp(self) -> RolloutPolicy:
        return self.policy.rollout

    # -- one tick --
    def run_once(self) -> str | None:
        """One reconciliation pass; returns what it did (None: nothing)."""
        self._absorb_pushes()
        now = self.clock()
        with session_scope(self.sessions) as s:
            p = lifecycle.active_promotion(s)
            if p is None:
                did = self._post_watch(s, now)
            elif not self._acquire(s, p, now):
                did = None
            else:
                did = self._step(s, p, now)
        self._push()
        self._mirror()
        if did:
            log.info("%s", did)
        return did

    def _acquire(self, s: Session, p: Promotion, now: datetime) -> bool:
        prev = p.lease_owner
        res = s.execute(update(Promotion).where(
            Promotion.id == p.id,
            or_(Promotion.lease_owner.is_(None), Promotion.lease_owner == self.owner, Promotion.lease_until < now))
            .values(lease_owner=self.owner, lease_until=now + timedelta(seconds=self.lease_s))
            .execution_options(synchronize_session="fetch"))
        if res.rowcount != 1:
            return False
        s.refresh(p)
        if prev is not None and prev != self.owner:
            p.attempts = (p.attempts or 0) + 1
            audit.record(s, actor=SYSTEM_ROLLOUT, action="promotion.resume", target=f"promotion:{p.id}",
                         before={"lease_owner": prev}, after={"lease_owner": self.owner, "state": p.state,
                                                              "attempts": p.attempts}, at=now)
        return True

    def _nodes(self, s: Session) -> list[Node]:
        return fleet.list_nodes(s)

    def _alive(self, n: Node, now: datetime) -> bool:
        return not fleet.is_stale(n, now, self.heartbeat_timeout_s)

    def _blocking(self, n: Node, now: datetime) -> bool:
        """Does this node hold a step up until it converges?"""
        return n.pinned_version is None and (self._alive(n, now) or self.rp.wait_for_stale_nodes)

    def _timed_out(self, p: Promotion, now: datetime) -> bool:
        return (now - p.updated_at).total_seconds() > self.rp.converge_timeout_s

    def _step(self, s: Session, p: Promotion, now: datetime) -> str | None:
        state = PromotionState(p.state)
        with _tracer.start_as_current_span(Spans.ROLLOUT) as span:
            span.set_attribute(SpanAttrs.VERSION, p.version)
            span.set_attribute("promotion_id", p.id)
            span.set_attribute("state", state.value)
            did = {P.pending: self._pending, P.canary: self._canary, P.watching: self._watching,
                   P.rolling_out: self._rolling_out, P.rolling_back: self._rolling_back}[state](s, p, now)
            span.set_attribute(SpanAttrs.DECISION, did or "wait")
        return did

    def _roll_back(self, s: Session, p: Promotion, now: datetime, reason: str) -> str:
        lifecycle.rollback(s, p.version, actor=SYSTEM_ROLLOUT, reason=reason, now=now)
        return f"promotion {p.id} of {p.version}: rolling back ({reason})"

    def _refused(self, version: str, nodes: Iterable[str]) -> str | None:
        for n in nodes:
            if (n, version) in self.refusals:
                return f"node {n} refused version {version}: {self.refusals[(n, version)]}"
        return None

    def _pending(self, s: Session, p: Promotion, now: datetime) -> str | None:
        nodes = self._nodes(s)
        alive = [n for n in nodes if self._alive(n, now)]
        base = live_metrics([n for n in alive if n.served_version == p.from_version or p.from_version is None])
        p.baseline = {"tau": base["tau"], "tps": base["tps"], "error_rate": base["error_rate"],
                      "nodes": base["nodes"], "at": now.isoformat(),
                      # each node's tau / TPS per load before the promotion (controlplane/canary_judge.py)
                      "profiles": {n.node_id: n.load_profile for n in alive if n.load_profile
                                   and n.load_profile.get("version") == p.from_version}}
        if not nodes:
            lifecycle.begin_rollout(s, p, actor=SYSTEM_ROLLOUT, now=now)
            lifecycle.complete_promotion(s, p, actor=SYSTEM_ROLLOUT, now=now)
            return f"promotion {p.id}: no nodes; {p.version} is champion"
        canaries = [n.node_id for n in nodes if n.role == NodeRole.canary.value and n.pinned_version is None]
        if not canaries:
            free = [n for n in alive if n.pinned_version is None]
            if not free:
                return None  # nobody to try it on yet: wait for a node
            count = max(1, math.ceil(self.rp.canary_fraction * len(free)))
            canaries = [n.node_id for n in free[:count]]
        lifecycle.begin_canary(s, p, canaries, actor=SYSTEM_ROLLOUT, now=now)
        return f"promotion {p.id}: canary {p.version} on {', '.join(canaries)}"

    def _canary(self, s: Session, p: Promotion, now: datetime) -> str | None:
        canaries = [n for n in self._nodes(s) if n.node_id in set(p.canary_nodes or [])]
        why = self._refused(p.version, [n.node_id for n in canaries])
        if why:
            return self._roll_back(s, p, now, why)
        waiting = [n for n in canaries if self._blocking(n, now) and n.served_version != p.version]
        serving = [n for n in canaries if n.served_version == p.version and self._alive(n, now)]
        if waiting or not serving:
            if self._timed_out(p, now):
                return self._roll_back(s, p, now, f"canaries did not serve {p.version} within "
                                                  f"{self.rp.converge_timeout_s:g} s: "
                                                  f"{', '.join(n.node_id for n in waiting) or 'none alive'}")
            return None
        lifecycle.begin_watch(s, p, self.rp.watch_window_s, actor=SYSTEM_ROLLOUT, now=now)
        p.baseline = {**(p.baseline or {}), "watch_heartbeats": {n.node_id: n.heartbeats or 0 for n in serving}}
        return f"promotion {p.id}: canaries serve {p.version}; watching until {p.watch_until.isoformat()}"

    def _regression(self, judged: list[Node], others: list[Node], baseline: dict | None) -> str | None:
        """The error rate against the policy's ceiling; tau and TPS against the nodes still on
        the outgoing version over the same window, else each node's own pre-promotion
        baseline at the same load (controlplane/canary_judge.py)."""
        err = judge({"error_rate": live_metrics(judged)["error_rate"]}, baseline, self.rp)
        rel = canary_judge.judge_relative(judged, others, baseline, self.rp)
        return "; ".join(x for x in (err, rel) if x) or None

    def _judged(self, nodes: list[Node], since: datetime, now: datetime) -> list[Node]:
        return [n for n in nodes if self._alive(n, now) and n.last_heartbeat_at is not None
                and n.last_heartbeat_at > since]

    def _watching(self, s: Session, p: Promotion, now: datetime) -> str | None:
        start = (p.baseline or {}).get("watch_heartbeats", {})
        canaries = [n for n in self._nodes(s) if n.node_id in set(p.canary_nodes or [])
                    and n.served_version == p.version]
        why = self._refused(p.version, p.canary_nodes or [])
        if why:
            return self._roll_back(s, p, now, why)
        watched = [n for n in canaries if (n.heartbeats or 0) > start.get(n.node_id, 0) and self._alive(n, now)]
        others = [n for n in self._judged(self._nodes(s), p.updated_at, now)
                  if n.node_id not in set(p.canary_nodes or []) and n.served_version == p.from_version]
        regression = self._regression(watched, others, p.baseline)
        if regression:
            return self._roll_back(s, p, now, f"live regression on canaries: {regression}")
        enough = [n for n in watched if (n.heartbeats or 0) - start.get(n.node_id, 0) >= self.rp.min_watch_heartbeats]
        alive_canaries = [n for n in canaries if self._alive(n, now)]
        if now < p.watch_until or not enough or len(enough) < len(alive_canaries):
            if now > p.watch_until + timedelta(seconds=self.rp.converge_timeout_s):
                return self._roll_back(s, p, now, f"no canary sent {self.rp.min_watch_heartbeats} heartbeats "
                                                  "inside the watch window")
            return None
        lifecycle.begin_rollout(s, p, actor=SYSTEM_ROLLOUT, now=now)
        return f"promotion {p.id}: canaries healthy; rolling {p.version} out to every node"

    def _rolling_out(self, s: Session, p: Promotion, now: datetime) -> str | None:
        nodes = self._nodes(s)
        why = self._refused(p.version, [n.node_id for n in nodes])
        if why:
            return self._roll_back(s, p, now, why)
        serving = [n for n in nodes if n.served_version == p.version]
        others = [n for n in self._judged(nodes, p.updated_at, now) if n.served_version == p.from_version]
        regression = self._regression(self._judged(serving, p.updated_at, now), others, p.baseline)
        if regression:
            return self._roll_back(s, p, now, f"live regression during rollout: {regression}")
        waiting = [n for n in nodes if self._blocking(n, now) and n.served_version != p.version]
        if waiting:
            if self._timed_out(p, now):
                return self._roll_back(s, p, now, f"nodes did not serve {p.version} within "
                                                  f"{self.rp.converge_timeout_s:g} s: "
                                                  f"{', '.join(n.node_id for n in waiting)}")
            return None
        lifecycle.complete_promotion(s, p, actor=SYSTEM_ROLLOUT, now=now)
        return f"promotion {p.id}: {p.version} is champion on every live node"

    def _rolling_back(self, s: Session, p: Promotion, now: datetime) -> str | None:
        back_to = p.from_version if p.kind == PromotionKind.promote.value else p.version
        if back_to is not None:
            waiting = [n for n in self._nodes(s) if self._blocking(n, now) and n.desired_version == back_to
                       and n.served_version != back_to]
            if waiting:
                return None
        if p.kind == PromotionKind.rollback.value:
            lifecycle.complete_promotion(s, p, actor=SYSTEM_ROLLOUT, now=now)
        else:
            lifecycle.advance_promotion(s, p, P.rolled_back, actor=SYSTEM_ROLLOUT, now=now)
        return f"promotion {p.id}: nodes serve {back_to} again"

    def _post_watch(self, s: Session, now: datetime) -> str | None:
        last = s.scalars(select(Promotion).order_by(Promotion.id.desc())).first()
        if (last is None or last.kind != PromotionKind.promote.value or last.state != P.completed.value
                or (now - last.updated_at).total_seconds() > self.rp.post_promotion_watch_s):
            return None
        v = s.get(Version, last.version)
        if v is None or v.state != VersionState.champion.value or not lifecycle.alias(s, ALIAS_PREVIOUS):
            return None
        serving = [n for n in self._nodes(s) if n.served_version == last.version]
        regression = self._regression(self._judged(serving, last.updated_at, now), [], last.baseline)
        if not regression:
            return None
        with _tracer.start_as_current_span(Spans.ROLLOUT) as span:
            span.set_attribute(SpanAttrs.VERSION, last.version)
            span.set_attribute(SpanAttrs.DECISION, "rollback")
            try:
                p = lifecycle.rollback(s, last.version, actor=SYSTEM_ROLLOUT,
                                       reason=f"live regression after promotion: {regression}", now=now)
            except Conflict as e:
                log.warning("cannot roll %s back: %s", last.version, e)
                return None
        return f"champion {last.version} rolled back by itself (promotion {p.id}): {regression}"

    # -- pushes and mirrors (after the transaction committed) --
    def _absorb_pushes(self) -> None:
        if self.pusher is None:
            return
        results = self.pusher.drain()
        if not results:
            return
        self.pushes = (self.pushes + results)[-1000:]
        with session_scope(self.sessions) as s:
            for r in results:
                if r.ok:
                    self.refusals.pop((r.node_id, r.version), None)
                    fleet.observe_served(s, r.node_id, r.version, actor=SYSTEM_ROLLOUT,
                                         how=f"push answered in {r.seconds * 1000:.0f} ms, pause {r.pause_ms} ms")
                elif r.refused:
                    self.refusals[(r.node_id, r.version)] = r.error or "refused"
                    audit.record(s, actor=SYSTEM_ROLLOUT, action="node.refused", target=f"node:{r.node_id}",
                                 after={"version": r.version, "error": r.error})
                else:
                    log.info("push of %s to %s failed: %s (heartbeats will converge it)", r.version, r.node_id,
                             r.error)

    def _push(self) -> None:
        if self.pusher is None:
            return
        now = self.clock()
        with self.sessions() as s:
            for n in self._nodes(s):
                d = fleet.desired(s, n.node_id)
                if (d is None or d.version == n.served_version or not n.url or not self._alive(n, now)
                        or (n.node_id, d.version) in self.refusals):
                    continue
                self.pusher.push(n.node_id, n.url, d.version, d.uri, d.sha256)

    def _mirror(self) -> None:
        """Version states and the champion / previous aliases into MLflow, when they changed."""
        if self.registry is None:
            return
        with self.sessions() as s:
            snap = (tuple(s.execute(select(Version.version, Version.state).order_by(Version.version)).all()),
                    lifecycle.alias(s, ALIAS_CHAMPION), lifecycle.alias(s, ALIAS_PREVIOUS))
            if snap == self._mirrored:
                return
            try:
                discovery.mirror_states(s, self.registry)
                self.registry.sync_aliases({ALIAS_CHAMPION: snap[1], ALIAS_PREVIOUS: snap[2]})
                self._mirrored = snap
            except Exception as e:  # MLflow down: the database decides; mirrored on a later tick
                log.warning("could not mirror states to MLflow: %s", e)
