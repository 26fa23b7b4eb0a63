"""The rollout reconciler step by step, on a real database with simulated heartbeats and a fake clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from adaflash.contracts import ALIAS_CHAMPION
from controlplane import fleet, lifecycle
from controlplane.db import session_scope, utcnow
from controlplane.gates import load_policy
from controlplane.models import AuditEntry, Node, Promotion
from controlplane.rollout import RolloutReconciler, judge, live_metrics
from tests.controlplane.reports import lineage, report

BASE = load_policy()


def policy(**rollout):
    return BASE.model_copy(update={"rollout": BASE.rollout.model_copy(update={
        "watch_window_s": 10.0, "min_watch_heartbeats": 2, "converge_timeout_s": 60.0, **rollout})})


class Clock:
    def __init__(self):
        self.now = utcnow()

    def __call__(self):
        return self.now

    def tick(self, s: float = 1.0):
        self.now += timedelta(seconds=s)


def approve(sessions, version: str, champion: str | None, clock: Clock):
    with session_scope(sessions) as s:
        lifecycle.register_version(s, version=version, target_id="tiny-target", source_uri=f"file:///a/{version}",
                                   run_id=None, manifest_sha256=f"{int(version):064x}", lineage=lineage(clock.now),
                                   created_at=clock.now, candidate_ttl_hours=72, actor="test")
        ev = lifecycle.start_evaluation(s, version, actor="test")
        lifecycle.complete_evaluation(s, ev.id, report(version, champion), {}, actor="test")
        lifecycle.apply_gates(s, version, ev.id, BASE, now=clock.now, default_ttl_days=30)
        lifecycle.approve(s, version, actor="key:approver")


def beat(sessions, clock: Clock, node_id: str, served: str | None, tau: float = 2.0, tps: float = 10.0,
         err: float = 0.0):
    with session_scope(sessions) as s:
        fleet.heartbeat(s, node_id, fleet.Heartbeat(served_version=served, url="", live_tau=tau, live_tps=tps,
                                                    error_rate=err), actor=f"node:{node_id}", now=clock.now)


def follow(sessions, clock: Clock, nodes: list[str], **metrics):
    """Every listed node serves what it is told and heartbeats."""
    with sessions() as s:
        want = {n: (fleet.desired(s, n).version if fleet.desired(s, n) else None) for n in nodes}
    for n in nodes:
        beat(sessions, clock, n, want[n], **metrics)


def promotion(sessions, version: str) -> Promotion:
    with sessions() as s:
        return s.scalars(select(Promotion).where(Promotion.version == version).order_by(Promotion.id.desc())).first()


@pytest.fixture
def fleet3(sessions, settings):
    """Three nodes serving champion 1; reconciler on a fake clock."""
    clock = Clock()
    approve(sessions, "1", None, clock)
    rec = RolloutReconciler(sessions, policy(), settings, clock=clock, owner="r1")
    assert "no nodes" in rec.run_once()  # an empty fleet: champion at once
    for n in ("n1", "n2", "n3"):
        beat(sessions, clock, n, "1")
    return clock, rec


def test_judge_edges():
    rp = BASE.rollout  # tau 5 %, tps 10 %, error 1 %
    base = {"tau": 2.0, "tps": 100.0, "error_rate": 0.0}
    assert judge({"tau": 1.9, "tps": 90.0, "error_rate": 0.01}, base, rp) is None  # exactly at every limit
    assert "live tau" in judge({"tau": 1.89, "tps": 100.0, "error_rate": 0.0}, base, rp)
    assert "live tps" in judge({"tau": 2.0, "tps": 89.0, "error_rate": 0.0}, base, rp)
    assert "error rate" in judge({"tau": None, "tps": None, "error_rate": 0.02}, base, rp)
    # An error rate already above the limit before the promotion only counts if it rises.
    assert judge({"tau": None, "tps": None, "error_rate": 0.02}, {**base, "error_rate": 0.02}, rp) is None
    assert judge({"tau": 1.0, "tps": 1.0, "error_rate": None}, None, rp) is None  # no baseline: nothing to judge


def test_live_metrics_count_only_nodes_with_traffic():
    busy = Node(node_id="a", live_tau=2.0, live_tps=10.0, error_rate=0.0)
    idle = Node(node_id="b", live_tau=0.0, live_tps=0.0, error_rate=0.005)
    m = live_metrics([busy, idle])
    assert m["tau"] == 2.0 and m["tps"] == 10.0 and m["error_rate"] == 0.005 and m["nodes"] == ["a"]


def test_canary_fraction_watch_and_rollout(sessions, fleet3):
    clock, rec = fleet3
    approve(sessions, "2", "1", clock)
    assert "canary 2 on n1" in rec.run_once()  # 25 % of 3 nodes: one, the first by id
    p = promotion(sessions, "2")
    assert p.state == "canary" and p.baseline["tau"] == 2.0 and p.baseline["nodes"] == ["n1", "n2", "n3"]
    assert rec.run_once() is None  # n1 has not loaded it yet
    clock.tick()
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert "watching" in rec.run_once()
    for _ in range(2):
        clock.tick(3)
        follow(sessions, clock, ["n1", "n2", "n3"])
        assert rec.run_once() is None  # window not over
    clock.tick(5)
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert "rolling 2 out" in rec.run_once()
    clock.tick()
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert "champion on every live node" in rec.run_once()
    with sessions() as s:
        assert lifecycle.alias(s, ALIAS_CHAMPION) == "2"


def test_canary_regression_rolls_back_by_itself(sessions, fleet3):
    clock, rec = fleet3
    approve(sessions, "2", "1", clock)
    rec.run_once()
    clock.tick()
    follow(sessions, clock, ["n1"], tau=1.2)  # the canary is worse than the baseline 2.0
    follow(sessions, clock, ["n2", "n3"])
    assert "watching" in rec.run_once()
    clock.tick()
    follow(sessions, clock, ["n1"], tau=1.2)
    assert "live regression on canaries" in rec.run_once()
    clock.tick()
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert "serve 1 again" in rec.run_once()
    assert promotion(sessions, "2").state == "rolled_back"
    with sessions() as s:
        assert lifecycle.get_version(s, "2").state == "rolled_back" and lifecycle.alias(s, ALIAS_CHAMPION) == "1"
        assert {n.desired_version for n in fleet.list_nodes(s)} == {"1"}


def test_canary_that_never_converges_times_out(sessions, fleet3, settings):
    clock, _ = fleet3
    rec = RolloutReconciler(sessions, policy(converge_timeout_s=30), settings, clock=clock, owner="r1")
    approve(sessions, "2", "1", clock)
    rec.run_once()
    clock.tick(20)
    beat(sessions, clock, "n1", "1")  # alive, but keeps serving the old version (it refused the new one)
    assert rec.run_once() is None
    clock.tick(15)
    beat(sessions, clock, "n1", "1")
    assert "did not serve 2 within 30 s" in rec.run_once()


@pytest.mark.parametrize("wait", [False, True])
def test_stale_node_holds_the_rollout_only_if_the_policy_says_so(sessions, fleet3, settings, wait):
    clock, _ = fleet3
    rec = RolloutReconciler(sessions, policy(wait_for_stale_nodes=wait, watch_window_s=0.0, min_watch_heartbeats=1),
                            settings, clock=clock, owner="r1")
    approve(sessions, "2", "1", clock)
    rec.run_once()
    for _ in range(3):  # n3 went silent
        clock.tick(settings.controlplane.heartbeat_timeout_s / 2 + 1)
        follow(sessions, clock, ["n1", "n2"])
        rec.run_once()
    p = promotion(sessions, "2")
    assert p.state == ("rolling_out" if wait else "completed")
    with sessions() as s:
        assert s.get(Node, "n3").desired_version == "2"  # it converges when it comes back
    follow(sessions, clock, ["n3"])
    rec.run_once()
    assert promotion(sessions, "2").state == "completed"


def test_lease_keeps_a_second_reconciler_out_until_it_expires(sessions, fleet3, settings):
    clock, rec = fleet3
    approve(sessions, "2", "1", clock)
    rec.run_once()  # r1 holds the lease
    other = RolloutReconciler(sessions, policy(), settings, clock=clock, owner="r2")
    clock.tick()
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert other.run_once() is None and promotion(sessions, "2").state == "canary"
    clock.tick(settings.controlplane.rollout_lease_s + 1)  # r1 died
    follow(sessions, clock, ["n1", "n2", "n3"])
    assert "watching" in other.run_once()
    p = promotion(sessions, "2")
    assert p.lease_owner == "r2" and p.attempts == 1
    with sessions() as s:
        entry = s.scalars(select(AuditEntry).where(AuditEntry.action == "promotion.resume")).one()
        assert entry.before == {"lease_owner": "r1"} and entry.after["state"] == "canary"


def test_rollout_steps_are_traced(sessions, settings):
    from adaflash.telemetry import CONTROLPLANE, Spans, reset_telemetry, setup_telemetry

    tel_settings = settings.model_copy(deep=True)
    tel_settings.telemetry.exporter = "memory"
    tel = setup_telemetry(CONTROLPLANE, tel_settings)
    try:
        clock = Clock()
        approve(sessions, "1", None, clock)
        RolloutReconciler(sessions, policy(), settings, clock=clock).run_once()
        spans = [s for s in tel.finished_spans() if s.name == Spans.ROLLOUT]
        assert spans and spans[0].attributes["version"] == "1" and spans[0].attributes["decision"].startswith(
            "promotion")
    finally:
        reset_telemetry()
