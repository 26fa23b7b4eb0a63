"""Heartbeats carry the node's measured cost curve; a version's shadow-predicted figures
are set against the live figures nodes report while serving it (API, plot, gate)."""

from __future__ import annotations

import pytest

from adaflash.contracts import ALIAS_CHAMPION
from adaflash.contracts.cost_curve import CostCurve
from controlplane import fleet, lifecycle
from controlplane.db import session_scope, utcnow
from controlplane.gates import GatePolicy, load_policy
from controlplane.models import Alias, Version
from dataplane.cost_model import CostModel
from tests.controlplane.reports import lineage, report


def _register(sessions, version: str) -> None:
    with session_scope(sessions) as s:
        lifecycle.register_version(s, version=version, target_id="tiny-target",
                                   source_uri=f"file:///artifacts/{version}/drafter", run_id=f"run{version}",
                                   manifest_sha256=f"{int(version):064x}", lineage=lineage(utcnow()),
                                   created_at=utcnow(), candidate_ttl_hours=72, actor="system:discovery")


def _evaluate(sessions, version: str, champion: str | None, policy: GatePolicy, cand_tau: float = 2.2) -> list:
    with session_scope(sessions) as s:
        ev = lifecycle.start_evaluation(s, version, actor="system:evaluator")
        lifecycle.complete_evaluation(s, ev.id, report(version, champion, cand_tau=cand_tau), {},
                                      actor="system:evaluator")
        return lifecycle.apply_gates(s, version, ev.id, policy, now=utcnow(), default_ttl_days=30)


def _measured_curve() -> dict:
    c = CostModel()
    for _ in range(3):
        c.observe_verify(1, 1, 0.010)
        c.observe_verify(1, 4, 0.030)
    return c.snapshot().model_dump(mode="json")


def test_heartbeats_store_the_cost_curve_and_fold_realised_figures(client, admin, make_key, sessions, monkeypatch):
    monkeypatch.setattr(fleet, "REALISED_EVERY_S", 0.0)  # every heartbeat counts here
    node = make_key("node", node_id="node-a")
    _register(sessions, "1")
    _evaluate(sessions, "1", None, load_policy())
    hb = {"served_version": "1", "url": "http://a", "live_tau": 2.0, "live_tps": 30.0, "live_load": 1.0,
          "cost_curve": _measured_curve()}
    assert client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=hb).status_code == 200
    hb |= {"live_tau": 1.6, "live_tps": 20.0, "live_load": 3.0}
    assert client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=hb).status_code == 200
    idle = hb | {"live_tau": 0.0, "live_tps": 0.0}  # served nothing: not a realised figure
    assert client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=idle).status_code == 200

    fig = client.get("/api/v1/versions/1", headers=admin).json()["figures"]
    assert fig["predicted_tau"] == pytest.approx(2.2) and fig["predicted_tps"] == pytest.approx(10.0)
    assert fig["realised_samples"] == 2 and fig["realised_tau"] == pytest.approx(1.8)
    assert fig["realised_tps"] == pytest.approx(25.0) and fig["realised_load"] == pytest.approx(2.0)
    assert fig["tau_ratio"] == pytest.approx(1.8 / 2.2)
    r = client.get("/api/v1/versions/1/plots/predicted_vs_realised", headers=admin)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content[:4] == b"\x89PNG"
    assert client.get("/api/v1/versions/9/plots/predicted_vs_realised", headers=admin).status_code == 404

    with sessions() as s:
        node_id, curve = fleet.latest_cost_curve(s)
    assert node_id == "node-a" and isinstance(curve, CostCurve) and curve.measured
    assert CostModel.from_snapshot(curve).step_time(1, 4) == pytest.approx(0.030)


def test_realised_figures_and_cost_curves_are_written_at_most_so_often(client, admin, make_key, sessions):
    node = make_key("node", node_id="node-d")
    _register(sessions, "1")
    hb = {"served_version": "1", "url": "http://d", "live_tau": 2.0, "live_tps": 30.0, "cost_curve": _measured_curve()}
    for tau in (2.0, 1.0, 1.0):
        hb["live_tau"] = tau
        assert client.post("/api/v1/nodes/node-d/heartbeat", headers=node, json=hb).status_code == 200
    fig = client.get("/api/v1/versions/1", headers=admin).json()["figures"]
    assert fig["realised_samples"] == 1 and fig["realised_tau"] == pytest.approx(2.0)


def test_a_cost_curve_that_breaks_the_contract_is_refused(client, make_key):
    node = make_key("node", node_id="node-b")
    bad = _measured_curve()
    bad["points"][0]["seconds"] = -1.0
    r = client.post("/api/v1/nodes/node-b/heartbeat", headers=node, json={"url": "http://b", "cost_curve": bad})
    assert r.status_code == 422 and "application/json" in r.headers["content-type"]


def test_priors_only_when_no_node_measured(sessions, client, make_key):
    node = make_key("node", node_id="node-c")
    prior = CostModel().snapshot().model_dump(mode="json")
    client.post("/api/v1/nodes/node-c/heartbeat", headers=node, json={"url": "http://c", "cost_curve": prior})
    with sessions() as s:
        assert fleet.latest_cost_curve(s) is None


def test_gate_on_the_champions_realised_figure(sessions):
    policy = load_policy()
    strict = policy.model_copy(update={"gates": policy.gates.model_copy(update={"min_champion_realised_ratio": 0.9})})
    _register(sessions, "1")
    _evaluate(sessions, "1", None, strict)
    with session_scope(sessions) as s:
        v = s.get(Version, "1")
        v.realised_tau, v.realised_samples = 1.5, 10  # predicted 2.2: realised 0.68 of it
        s.add(Alias(name=ALIAS_CHAMPION, version="1", updated_at=utcnow()))  # as a completed promotion leaves it
    _register(sessions, "2")
    results = {r.name: r for r in _evaluate(sessions, "2", "1", strict, cand_tau=2.4)}
    gate = results["champion_realised_ratio"]
    assert not gate.passed and gate.value == pytest.approx(1.5 / 2.2) and gate.threshold == 0.9
    _register(sessions, "3")
    assert "champion_realised_ratio" not in {r.name for r in _evaluate(sessions, "3", "1", policy, cand_tau=2.4)}
