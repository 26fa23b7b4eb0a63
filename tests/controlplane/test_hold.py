"""The fleet's learning hold through the admin API (controlplane/hold.py): who may read and set
it, its audit trail, refused bodies, and when it has taken effect (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane import hold
from controlplane.db import utcnow
from controlplane.models import HoldSeen, Version

pytestmark = pytest.mark.parametrize("settings", ["sqlite", "postgresql"], indirect=True)


def _put(client, key, **body):
    return client.put("/api/v1/hold", headers=key, json=body)


def test_an_admin_holds_and_lifts_learning_and_evaluation_and_the_audit_log_says_so(client, admin, make_key):
    viewer = make_key("viewer")
    r = client.get("/api/v1/hold", headers=viewer)
    assert r.status_code == 200, r.text
    assert r.json()["learning"] is False and r.json()["evaluation"] is False and r.json()["set_at"] is None
    r = _put(client, admin, learning=True, evaluation=True, reason="measuring the node alone")
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["learning"] and h["evaluation"] and h["reason"] == "measuring the node alone"
    assert h["set_by"].startswith("key:") and h["set_at"]
    assert client.get("/api/v1/hold", headers=make_key("auditor", tenants=["acme"])).json()["learning"] is True
    r = _put(client, admin, learning=False, evaluation=False, reason="measurement done")
    assert r.status_code == 200 and not r.json()["learning"] and not r.json()["evaluation"]
    entries = client.get("/api/v1/audit", headers=admin, params={"action": "hold.set"}).json()
    assert [(e["before"], e["after"]["learning"]) for e in entries] == [(None, True), (entries[1]["before"], False)]
    assert entries[1]["before"]["reason"] == "measuring the node alone"


def test_only_an_admin_sets_the_hold_and_a_learner_reads_only_as_itself(client, admin, make_key):
    for role in ("viewer", "approver"):
        r = _put(client, make_key(role), learning=True, evaluation=False, reason="x")
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    learner = make_key("learner", node_id="learner")
    assert client.get("/api/v1/learners/learner/hold", headers=learner).status_code == 200
    assert client.get("/api/v1/learners/learner-2/hold", headers=learner).status_code == 403
    assert client.get("/api/v1/hold", headers=learner).status_code == 403
    assert client.get("/api/v1/learners/learner/hold", headers=make_key("node", node_id="n1")).status_code == 403
    assert client.get("/api/v1/hold", headers=admin).json()["learning"] is False  # nothing changed


@pytest.mark.parametrize("body", [{"learning": True, "evaluation": False},  # no reason
                                  {"learning": 1, "evaluation": False, "reason": "x"},  # not a boolean
                                  {"learning": True, "evaluation": False, "reason": ""},
                                  {"learning": True, "evaluation": False, "reason": "x", "serving": True}])
def test_bad_bodies_are_refused_with_a_json_error_and_change_nothing(client, admin, body):
    r = client.put("/api/v1/hold", headers=admin, json=body)
    assert r.status_code == 422 and r.json()["error"] == "validation_error", r.text
    assert client.get("/api/v1/hold", headers=admin).json()["set_at"] is None


def test_the_hold_takes_effect_once_every_running_learner_read_it_and_no_evaluation_runs(client, admin, make_key,
                                                                                         sessions):
    a, b = make_key("learner", node_id="learner"), make_key("learner", node_id="learner-2")
    for key, lid in ((a, "learner"), (b, "learner-2")):
        assert client.get(f"/api/v1/learners/{lid}/hold", headers=key).json()["quiet"] is True  # nothing held
    h = _put(client, admin, learning=True, evaluation=False, reason="measuring").json()
    assert h["quiet"] is False and {x["learner_id"]: x["quiet"] for x in h["learners"]} == {
        "learner": False, "learner-2": False}
    client.get("/api/v1/learners/learner/hold", headers=a)
    assert client.get("/api/v1/hold", headers=admin).json()["quiet"] is False  # learner-2 may be mid-step
    client.get("/api/v1/learners/learner-2/hold", headers=b)
    assert client.get("/api/v1/hold", headers=admin).json()["quiet"] is True
    # a learner silent for longer than ACTIVE_S is not running: it does not keep the hold from taking effect
    with sessions() as s:
        s.add(HoldSeen(learner_id="learner-gone", seen_at=utcnow() - timedelta(seconds=hold.ACTIVE_S + 5)))
        s.commit()
    _put(client, admin, learning=True, evaluation=True, reason="measuring, evaluation too")
    client.get("/api/v1/learners/learner/hold", headers=a)
    assert client.get("/api/v1/hold", headers=admin).json()["quiet"] is False
    client.get("/api/v1/learners/learner-2/hold", headers=b)
    assert client.get("/api/v1/hold", headers=admin).json()["quiet"] is True
    # a version under evaluation keeps an evaluation hold from having taken effect until it finishes
    with sessions() as s:
        s.add(Version(version="7", target_id="t", source_uri="models:/x/7", state="evaluating"))
        s.commit()
    h = client.get("/api/v1/hold", headers=admin).json()
    assert h["evaluating"] == ["7"] and h["quiet"] is False
    _put(client, admin, learning=True, evaluation=False, reason="learning only")
    for key, lid in ((a, "learner"), (b, "learner-2")):
        client.get(f"/api/v1/learners/{lid}/hold", headers=key)
    assert client.get("/api/v1/hold", headers=admin).json()["quiet"] is True
