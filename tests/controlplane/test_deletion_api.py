"""Deletion requests in the admin API: work lists, acknowledgements, roles, completion, retries."""

from __future__ import annotations

from controlplane import deletion, tenants
from controlplane.db import session_scope


def _ack(client, headers, rid, component, instance, **kw):
    return client.post(f"/api/v1/deletion-requests/{rid}/ack", headers=headers,
                       json={"component": component, "instance": instance, **kw})


def test_work_lists_acks_and_completion(client, admin, make_key):
    node = make_key("node", node_id="node-a")
    learner = make_key("learner", node_id="learner")
    hb = {"served_version": None, "url": "http://127.0.0.1:8000", "live_tau": 1.0}
    assert client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=hb).status_code == 200

    r = client.post("/api/v1/deletion-requests", headers=admin, json={"tenant_id": "acme"})
    assert r.status_code == 201, r.text
    req = r.json()
    assert req["state"] == "running" and req["reason"] == "deletion requested"
    assert req["waiting_for"] == ["node:node-a", "learner:learner"] and req["provisional"] is True
    assert {p["store"] for p in req["pending"]} == {"kafka:adaflash.feedback.v1", "kafka:adaflash.feedback.dlq.v1"}

    # Each component sees the open requests awaiting it, only as itself.
    work = client.get("/api/v1/deletion-requests", headers=node).json()
    assert [w["id"] for w in work] == [req["id"]]
    assert client.get("/api/v1/deletion-requests?instance=node-b", headers=node).status_code == 403
    assert client.get("/api/v1/deletion-requests?instance=other", headers=learner).status_code == 403
    assert _ack(client, node, req["id"], "learner", "learner").status_code == 403
    assert _ack(client, learner, req["id"], "learner", "other").status_code == 403
    assert _ack(client, make_key("viewer"), req["id"], "node", "node-a").status_code == 403
    assert _ack(client, node, req["id"], "node", "node-a", purged={"spool": 3}).status_code == 200
    assert client.get("/api/v1/deletion-requests", headers=node).json() == []
    again = _ack(client, node, req["id"], "node", "node-a", purged={"spool": 99})  # repeated: no-op
    assert again.status_code == 200 and again.json()["waiting_for"] == ["learner:learner"]
    done = _ack(client, learner, req["id"], "learner", "learner", purged={"replay_buffer": 1}).json()
    assert done["state"] == "completed" and done["completed_at"] and not done["provisional"]
    assert done["result"]["purged"]["node:node-a"] == {"spool": 3}
    assert client.get("/api/v1/deletion-requests", headers=learner).json() == []
    assert [d["id"] for d in client.get("/api/v1/deletion-requests?state=completed", headers=admin).json()] == \
        [req["id"]]
    assert client.get("/api/v1/deletion-requests?state=open", headers=admin).json() == []
    actions = [e["action"] for e in client.get("/api/v1/audit?tenant_id=acme", headers=admin).json()]
    assert actions == ["deletion.request", "deletion.purge", "deletion.ack", "deletion.ack", "deletion.complete"]
    assert client.get("/api/v1/audit/verify", headers=admin).json()["ok"] is True
    # an auditor of another tenant sees none of it
    other = make_key("auditor", tenants=["globex"])
    assert client.get(f"/api/v1/deletion-requests/{req['id']}", headers=other).status_code == 403


def test_admin_acks_for_a_node_that_is_gone(client, admin, make_key):
    node = make_key("node", node_id="dead-node")
    hb = {"served_version": None, "url": "http://127.0.0.1:8000", "live_tau": 1.0}
    client.post("/api/v1/nodes/dead-node/heartbeat", headers=node, json=hb)
    rid = client.post("/api/v1/deletion-requests", headers=admin, json={"tenant_id": "acme"}).json()["id"]
    r = _ack(client, admin, rid, "node", "dead-node", detail={"reason": "volume destroyed"})
    assert r.status_code == 200 and r.json()["waiting_for"] == ["learner:learner"]
    entry = client.get("/api/v1/audit?action=deletion.ack", headers=admin).json()[-1]
    assert entry["actor"].startswith("key:") and entry["after"]["detail"] == {"reason": "volume destroyed"}


def test_other_scopes_are_stored_not_executed(client, admin, make_key):
    learner = make_key("learner")
    r = client.post("/api/v1/deletion-requests", headers=admin,
                    json={"tenant_id": "acme", "scope": "records", "ids": ["r1"], "reason": "GDPR art. 17"})
    assert r.status_code == 201 and r.json()["state"] == "pending"
    assert client.get("/api/v1/deletion-requests?instance=learner", headers=learner).json() == []
    assert _ack(client, learner, r.json()["id"], "learner", "learner").status_code == 409


def test_the_workers_pass_executes_what_the_request_did_not(app, settings, client, admin):
    sessions = app.state.sessions
    with session_scope(sessions) as s:  # as if the control plane died right after storing it
        rid = tenants.create_deletion(s, tenant_id="acme", scope="tenant", ids=[], reason="x", actor="test").id
    assert client.get(f"/api/v1/deletion-requests/{rid}", headers=admin).json()["state"] == "pending"
    assert deletion.reconcile(sessions, settings) == [rid]
    got = client.get(f"/api/v1/deletion-requests/{rid}", headers=admin).json()
    assert got["state"] == "running" and got["components"][0]["state"] == "acked"
    assert deletion.reconcile(sessions, settings) == []  # nothing more until the learner acks
