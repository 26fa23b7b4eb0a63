"""The rollout guard judges a canary at the load it has: against the nodes still on the
outgoing version over the same window, else against its own pre-promotion baseline at a
similar load; never against a fixed TPS. Simulated heartbeats, a fake clock, a real database."""

from __future__ import annotations

import pytest

from controlplane import fleet
from controlplane.canary_judge import load_bucket
from controlplane.db import session_scope
from controlplane.rollout import RolloutReconciler, judge, live_metrics
from tests.controlplane.test_rollout_steps import Clock, approve, policy, promotion

# on SQLite and on PostgreSQL (a copy of the session's migrated database per test)
pytestmark = pytest.mark.parametrize("settings", ["sqlite", pytest.param("postgresql", marks=pytest.mark.services)],
                                     indirect=True)


def beat(sessions, clock, node_id, served, *, tps, load, tau=2.0):
    with session_scope(sessions) as s:
        fleet.heartbeat(s, node_id, fleet.Heartbeat(served_version=served, url="", live_tau=tau, live_tps=tps,
                                                    error_rate=0.0, live_load=load),
                        actor=f"node:{node_id}", now=clock.now)


def desired(sessions, nodes):
    with sessions() as s:
        return {n: fleet.desired(s, n).version for n in nodes}


def start(sessions, settings, nodes, *, before=((10.0, 4.0),), **rollout):
    """Champion 1 on ``nodes`` (heartbeats at each (tps, load) of ``before``), candidate 2
    approved, canary chosen."""
    clock = Clock()
    approve(sessions, "1", None, clock)
    rec = RolloutReconciler(sessions, policy(**rollout), settings, clock=clock, owner="r1")
    rec.run_once()
    for tps, load in before:
        for _ in range(3):
            for n in nodes:
                beat(sessions, clock, n, "1", tps=tps, load=load)
            clock.tick()
    approve(sessions, "2", "1", clock)
    assert "canary 2" in rec.run_once()
    return clock, rec


def watch(sessions, clock, rec, nodes, metrics: dict) -> str | None:
    """Every node serves what it is told and reports ``metrics[node]`` (tps, load) for a few ticks."""
    last = None
    for _ in range(6):
        clock.tick(3)
        want = desired(sessions, nodes)
        for n in nodes:
            tps, load = metrics[n]
            beat(sessions, clock, n, want[n], tps=tps, load=load)
        last = rec.run_once() or last
        if last and ("rolling back" in last or "rolling 2 out" in last):
            return last
    return last


def test_traffic_drop_during_watch_is_not_a_regression(sessions, settings):
    """Load halves on every node while the canary is watched: TPS halves everywhere. A fixed
    TPS baseline calls that a regression; canary against baseline nodes does not."""
    nodes = ["n1", "n2", "n3", "n4"]
    clock, rec = start(sessions, settings, nodes)
    p = promotion(sessions, "2")
    assert p.canary_nodes == ["n1"]
    with sessions() as s:
        canary = [n for n in fleet.list_nodes(s) if n.node_id == "n1"]
    canary[0].live_tps, canary[0].live_load = 5.0, 2.0
    assert "live tps" in (judge(live_metrics(canary), p.baseline, policy().rollout) or "")  # the old guard
    got = watch(sessions, clock, rec, nodes, {n: (5.0, 2.0) for n in nodes})
    assert got and "rolling 2 out" in got, got


def test_canary_slower_than_baseline_nodes_at_the_same_load_rolls_back(sessions, settings):
    nodes = ["n1", "n2", "n3", "n4"]
    clock, rec = start(sessions, settings, nodes)
    got = watch(sessions, clock, rec, nodes, {"n1": (8.0, 4.0), "n2": (10.0, 4.0), "n3": (10.0, 4.0),
                                              "n4": (10.0, 4.0)})
    assert got and "rolling back" in got and "baseline nodes" in got and "tps 0.800x" in got, got


def test_tps_not_compared_across_different_loads(sessions, settings):
    """The canary got half the traffic: its lower TPS says nothing; its tau is still judged."""
    nodes = ["n1", "n2", "n3", "n4"]
    clock, rec = start(sessions, settings, nodes)
    metrics = {"n1": (5.0, 2.0), "n2": (10.0, 4.0), "n3": (10.0, 4.0), "n4": (10.0, 4.0)}
    got = watch(sessions, clock, rec, nodes, metrics)
    assert got and "rolling 2 out" in got, got


def test_single_node_compared_with_its_own_baseline_at_similar_load(sessions, settings):
    """One node: before the promotion it served 20 tok/s at 8 requests and 5 at 1. As the
    canary at 8 requests, 19 tok/s is fine (a fixed 5 tok/s baseline would say so too, for
    the wrong reason); at 1 request, 4 tok/s is a 20 % regression."""
    clock, rec = start(sessions, settings, ["n1"], before=((5.0, 1.0), (20.0, 8.0)), canary_fraction=1.0)
    p = promotion(sessions, "2")
    prof = p.baseline["profiles"]["n1"]
    assert prof["version"] == "1" and set(prof["buckets"]) == {load_bucket(1.0), load_bucket(8.0)}
    got = watch(sessions, clock, rec, ["n1"], {"n1": (19.0, 8.0)})
    assert got and "rolling 2 out" in got, got
    got = watch(sessions, clock, rec, ["n1"], {"n1": (4.0, 1.0)})
    assert got and "rolling back" in got and "own baseline" in got, got


def test_single_node_far_from_any_baseline_load_is_judged_on_tau_only(sessions, settings):
    """Seen only at 1 request before the promotion, the node now carries 30: its TPS has no
    baseline at that load (not judged), its tau is compared with the closest load seen."""
    clock, rec = start(sessions, settings, ["n1"], before=((5.0, 1.0),), canary_fraction=1.0)
    got = watch(sessions, clock, rec, ["n1"], {"n1": (1.0, 30.0)})
    assert got and "rolling 2 out" in got, got  # 1 tok/s at 30 requests vs 5 at 1: not comparable


def test_single_node_tau_drop_at_an_unseen_load_rolls_back(sessions, settings):
    clock, rec = start(sessions, settings, ["n1"], before=((5.0, 1.0),), canary_fraction=1.0)
    last = None  # the canary's tau halves
    for _ in range(6):
        clock.tick(3)
        want = desired(sessions, ["n1"])
        beat(sessions, clock, "n1", want["n1"], tps=1.0, load=30.0, tau=1.0)
        last = rec.run_once() or last
        if last and "rolling back" in last:
            break
    assert last and "rolling back" in last and "live tau" in last and "live tps" not in last, last
