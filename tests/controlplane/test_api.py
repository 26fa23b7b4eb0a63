"""The admin API over a real database: a version's life, nodes, tenants, errors, the audit trail."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest

from controlplane import lifecycle
from controlplane.db import session_scope, utcnow
from controlplane.gates import load_policy
from tests.controlplane.reports import lineage, report

# A 1x1 PNG.
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
POLICY = load_policy()


def register(sessions, version: str, created=None):
    now = utcnow()
    with session_scope(sessions) as s:
        lifecycle.register_version(s, version=version, target_id="tiny-target",
                                   source_uri=f"file:///artifacts/{version}/drafter", run_id=f"run{version}",
                                   manifest_sha256=f"{int(version):064x}", lineage=lineage(now),
                                   created_at=created or now, candidate_ttl_hours=72, actor="system:discovery")


def evaluate(sessions, version: str, champion: str | None, rep: dict | None = None, plots=None, policy=POLICY):
    with session_scope(sessions) as s:
        ev = lifecycle.start_evaluation(s, version, actor="system:evaluator")
        lifecycle.complete_evaluation(s, ev.id, rep or report(version, champion), plots or {},
                                      actor="system:evaluator")
        lifecycle.apply_gates(s, version, ev.id, policy, now=utcnow(), default_ttl_days=30)
        return ev.id


def roll_out(sessions, version: str):
    """What the reconciler will do once the nodes converge (next round): no canaries here."""
    with session_scope(sessions) as s:
        p = lifecycle.active_promotion(s, version)
        lifecycle.begin_rollout(s, p, actor="system:rollout")
        lifecycle.complete_promotion(s, p, actor="system:rollout")


@pytest.mark.parametrize("settings", ["sqlite", pytest.param("postgresql", marks=pytest.mark.services)],
                         indirect=True)
def test_version_lifecycle_through_the_api(client, admin, make_key, sessions, settings):
    approver, node = make_key("approver"), make_key("node", node_id="node-a")
    hb = {"served_version": None, "url": "http://127.0.0.1:8000", "live_tau": 1.0, "live_tps": 9.5, "error_rate": 0}
    r = client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=hb)
    assert r.status_code == 200 and r.json()["desired"] is None

    # v1: first candidate, no champion; approved by a person, rolled out.
    register(sessions, "1")
    evaluate(sessions, "1", None, report("1", None, tenants={}, domains={}))
    v1 = client.get("/api/v1/versions/1", headers=admin).json()
    assert v1["state"] == "awaiting_approval" and all(g["passed"] for g in v1["gate_results"])
    r = client.post("/api/v1/versions/1/approve", headers=approver, json={"reason": "first drafter"})
    assert r.status_code == 200 and r.json()["state"] == "approved"
    assert r.json()["approvals"][0]["actor"].startswith("key:")
    assert r.json()["promotions"][0]["state"] == "pending"
    roll_out(sessions, "1")
    desired = client.get("/api/v1/nodes/node-a/desired", headers=node).json()
    assert desired == {"version": "1", "uri": "file:///artifacts/1/drafter", "sha256": f"{1:064x}"}

    # v2 beats v1 and becomes champion; v1 is `previous`.
    register(sessions, "2")
    evaluate(sessions, "2", "1")
    assert client.post("/api/v1/versions/2/approve", headers=approver, json={}).status_code == 200
    roll_out(sessions, "2")
    listed = {v["version"]: v for v in client.get("/api/v1/versions", headers=admin).json()}
    assert listed["2"]["state"] == "champion" and listed["2"]["aliases"] == ["champion"]
    assert listed["1"]["state"] == "retired" and listed["1"]["aliases"] == ["previous"]

    # v3 regresses on one tenant: gate_failed, and approving it is refused.
    register(sessions, "3")
    evaluate(sessions, "3", "2", report("3", "2", tenants={"acme": (150, 2.2, 1.5), "globex": (150, 2.2, 2.6)}))
    v3 = client.get("/api/v1/versions/3", headers=admin).json()
    assert v3["state"] == "gate_failed" and "max_tenant_regression" in v3["state_reason"]
    r = client.post("/api/v1/versions/3/approve", headers=approver, json={})
    assert r.status_code == 409 and "gate_failed" in r.json()["message"]
    assert client.post("/api/v1/versions/3/reject", headers=approver, json={"reason": "acme regressed"}).json()[
        "state"] == "rejected"

    # Operator rollback in one call: v1 serves again.
    r = client.post("/api/v1/versions/2/rollback", headers=approver, json={"reason": "users report drift"})
    assert r.status_code == 200 and r.json()["kind"] == "rollback" and r.json()["version"] == "1"
    assert client.get("/api/v1/nodes/node-a/desired", headers=node).json()["version"] == "1"
    states = {v["version"]: v["state"] for v in client.get("/api/v1/versions", headers=admin).json()}
    assert states == {"1": "champion", "2": "rolled_back", "3": "rejected"}
    r = client.post("/api/v1/versions/1/rollback", headers=approver, json={"reason": "again"})
    assert r.status_code == 409  # a rollback is still converging

    # Every action is in the audit log, and the chain verifies.
    actions = [e["action"] for e in client.get("/api/v1/audit?limit=500", headers=admin).json()]
    for a in ("key.create", "node.register", "version.register", "version.evaluating", "evaluation.complete",
              "version.awaiting_approval", "version.approved", "promotion.create", "promotion.rolling_out",
              "promotion.completed", "alias.set", "version.champion", "version.retired", "version.gate_failed",
              "version.rejected", "version.rolled_back", "promotion.rolling_back", "nodes.desired"):
        assert a in actions, a
    approved = client.get("/api/v1/audit?action=version.approved", headers=admin).json()[0]
    assert approved["before"]["state"] == "awaiting_approval" and approved["after"]["state"] == "approved"
    assert client.get("/api/v1/audit/verify", headers=admin).json() == {
        "ok": True, "entries": len(actions), "first_bad_seq": None, "reason": ""}


def test_auto_approval_policy(client, admin, sessions):
    policy = POLICY.model_copy(update={"approval": "auto"})
    register(sessions, "1")
    evaluate(sessions, "1", None, report("1", None), policy=policy)
    v = client.get("/api/v1/versions/1", headers=admin).json()
    assert v["state"] == "approved" and v["approvals"][0]["actor"] == "system:policy"


def test_canary_rollback_returns_canaries_to_the_champion(client, admin, make_key, sessions):
    for n in ("node-a", "node-b"):
        client.post(f"/api/v1/nodes/{n}/heartbeat", headers=admin, json={"url": f"http://{n}"})
    assert client.put("/api/v1/nodes/node-a", headers=admin, json={"role": "canary"}).json()["role"] == "canary"
    register(sessions, "1")
    evaluate(sessions, "1", None, report("1", None))
    client.post("/api/v1/versions/1/approve", headers=admin, json={})
    roll_out(sessions, "1")
    register(sessions, "2")
    evaluate(sessions, "2", "1")
    client.post("/api/v1/versions/2/approve", headers=admin, json={})
    with session_scope(sessions) as s:
        lifecycle.begin_canary(s, lifecycle.active_promotion(s, "2"), ["node-a"], actor="system:rollout")
    nodes = {n["node_id"]: n["desired_version"] for n in client.get("/api/v1/nodes", headers=admin).json()}
    assert nodes == {"node-a": "2", "node-b": "1"}
    r = client.post("/api/v1/versions/2/rollback", headers=admin, json={"reason": "canary tau fell"})
    assert r.status_code == 200 and r.json()["state"] == "rolling_back"
    nodes = {n["node_id"]: n["desired_version"] for n in client.get("/api/v1/nodes", headers=admin).json()}
    assert nodes == {"node-a": "1", "node-b": "1"}


def test_pin_overrides_desired_version(client, admin, sessions):
    client.post("/api/v1/nodes/node-a/heartbeat", headers=admin, json={"url": "http://a"})
    register(sessions, "1")
    r = client.post("/api/v1/versions/1/pin", headers=admin, json={"reason": "hold"})
    assert r.status_code == 409 and "registered" in r.json()["message"]  # not approved: cannot be pinned
    evaluate(sessions, "1", None, report("1", None))
    client.post("/api/v1/versions/1/approve", headers=admin, json={})
    r = client.post("/api/v1/versions/1/pin", headers=admin, json={"node_ids": ["node-a"], "reason": "hold"})
    assert r.json() == {"version": "1", "nodes": ["node-a"]}
    assert client.get("/api/v1/nodes/node-a/desired", headers=admin).json()["version"] == "1"
    r = client.post("/api/v1/versions/1/pin", headers=admin, json={"node_ids": ["ghost"], "reason": "x"})
    assert r.status_code == 404 and "ghost" in r.json()["message"]
    client.post("/api/v1/versions/1/unpin", headers=admin, json={"reason": "release"})
    assert client.get("/api/v1/nodes/node-a/desired", headers=admin).json() is None


def test_expired_candidates_are_reaped(client, admin, sessions):
    register(sessions, "1", created=utcnow() - timedelta(hours=73))
    with session_scope(sessions) as s:
        assert lifecycle.expire_candidates(s) == ["1"]
    v = client.get("/api/v1/versions/1", headers=admin).json()
    assert v["state"] == "expired" and "TTL" in v["state_reason"]


def test_evaluation_report_and_plot(client, admin, sessions, settings):
    plot_dir = settings.home / "evaluations" / "1"
    plot_dir.mkdir(parents=True)
    (plot_dir / "tau.png").write_bytes(PNG)
    register(sessions, "1")
    ev = evaluate(sessions, "1", None, report("1", None), plots={"tau": "1/tau.png", "evil": "../../admin-token"})
    r = client.get(f"/api/v1/evaluations/{ev}", headers=admin)
    assert r.json()["report"]["candidate"]["tau"] == 2.2 and r.json()["plots"] == ["evil", "tau"]
    r = client.get(f"/api/v1/evaluations/{ev}/plots/tau", headers=admin)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content == PNG
    assert client.get(f"/api/v1/evaluations/{ev}/plots/evil", headers=admin).status_code == 404
    assert client.get(f"/api/v1/evaluations/{ev}/plots/none", headers=admin).status_code == 404
    assert [e["id"] for e in client.get("/api/v1/evaluations?version=1", headers=admin).json()] == [ev]


def test_tenant_policies(client, admin, make_key):
    node = make_key("node")
    default = client.get("/api/v1/tenants/newco/policy", headers=node).json()
    assert default == {"tenant_id": "newco", "sampling_rate": 1.0, "opt_out": False, "ttl_days": 30.0,
                       "share_cap": 0.5, "weight": None, "max_queued": None, "max_tokens": None}
    r = client.put("/api/v1/tenants/newco/policy", headers=admin,
                   json={"sampling_rate": 0.1, "opt_out": True, "ttl_days": 7, "share_cap": 0.2,
                         "weight": 2.5, "max_queued": 16, "max_tokens": 4096})
    assert r.status_code == 200
    got = client.get("/api/v1/tenants/newco/policy", headers=node).json()
    assert got["opt_out"] is True and (got["weight"], got["max_queued"], got["max_tokens"]) == (2.5, 16, 4096)
    entry = client.get("/api/v1/audit?action=tenant.policy", headers=admin).json()[-1]
    assert entry["tenant_id"] == "newco" and entry["before"] is None and entry["after"]["sampling_rate"] == 0.1
    r = client.put("/api/v1/tenants/newco/policy", headers=admin, json={"sampling_rate": 2})
    assert r.status_code == 422 and r.json()["details"][0]["loc"] == ["body", "sampling_rate"]


@pytest.mark.parametrize("body, status, fragment", [
    ({"tenant_id": "acme", "scope": "tenant", "ids": ["r1"], "reason": "x"}, 422, "takes no ids"),
    ({"tenant_id": "acme", "scope": "records", "reason": "x"}, 422, "needs at least one id"),
    ({"tenant_id": "ac me", "scope": "tenant", "reason": "x"}, 422, "tenant_id"),
    ({"tenant_id": "acme", "scope": "records", "ids": ["r1", "r2"], "reason": "GDPR art. 17"}, 201, ""),
])
def test_deletion_requests(client, admin, body, status, fragment):
    r = client.post("/api/v1/deletion-requests", headers=admin, json=body)
    assert r.status_code == status, r.text
    assert fragment in r.text
    if status == 201:
        assert r.json()["state"] == "pending" and r.json()["requested_by"].startswith("key:")


def test_errors_are_json_with_clear_messages(client, admin):
    r = client.post("/api/v1/versions/1/reject", headers={**admin, "Content-Type": "application/json"},
                    content=b"{not json")
    assert r.status_code == 400 and r.json()["error"] == "malformed_json"
    assert r.json()["message"].startswith("malformed JSON body")
    r = client.post("/api/v1/versions/1/reject", headers=admin, json={})
    assert r.status_code == 422 and r.json()["message"] == "invalid request: body.reason: Field required"
    r = client.post("/api/v1/versions/1/reject", headers=admin, json={"reason": "x", "extra": 1})
    assert r.status_code == 422 and "extra" in r.json()["message"]
    r = client.post("/api/v1/versions/1/reject", headers=admin, json={"reason": "nul\x00byte"})
    assert r.status_code == 422 and r.json()["message"].startswith("invalid request: body.reason: String should match")
    r = client.get("/api/v1/versions/nope", headers=admin)
    assert r.status_code == 404 and r.json() == {"error": "not_found", "message": "version 'nope' not found"}
    assert client.get("/api/v1/nowhere", headers=admin).json()["error"] == "not_found"
    assert client.get("/api/v1/versions?limit=0", headers=admin).status_code == 422
