"""Authentication on every route, roles, tenant scopes, node binding, JWTs, the admin token."""

from __future__ import annotations

import logging
import re
import stat
import time

import jwt
import pytest
from fastapi.testclient import TestClient

from adaflash.config import load_config
from controlplane.api import create_app

SECRET = "s3cret-for-tests-only-0123456789abcdef"  # JWT tests only
PATH_VALUES = {"version": "1", "node_id": "node-a", "tenant_id": "acme", "evaluation_id": "1", "name": "tau",
               "request_id": "1", "key_id": "abc123", "learner_id": "learner"}


def operations(app):
    for path, ops in app.openapi()["paths"].items():
        for method in ops:
            yield method.upper(), re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m.group(1)], path)


def test_every_route_in_the_openapi_document_needs_credentials(app, client):
    ops = list(operations(app))
    assert len(ops) >= 25
    for headers in ({}, {"Authorization": "Bearer adf_nope_nope"}, {"Authorization": "Bearer not-a-key"},
                    {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer a.b.c"}):
        for method, path in ops:
            r = client.request(method, path, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.json()["error"] == "unauthorized" and r.json()["message"]
            assert r.headers["www-authenticate"] == "Bearer"


def test_spec_and_docs_are_public(client):
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/docs").status_code == 200
    assert client.get("/healthz").json() == {"status": "ok"}


def test_viewer_reads_but_cannot_approve_or_administer(client, make_key):
    viewer = make_key("viewer")
    assert client.get("/api/v1/versions", headers=viewer).status_code == 200
    r = client.post("/api/v1/versions/1/approve", headers=viewer, json={"reason": "looks good"})
    assert r.status_code == 403 and "role viewer may not" in r.json()["message"]
    assert client.post("/api/v1/versions/1/reject", headers=viewer, json={"reason": "no"}).status_code == 403
    assert client.put("/api/v1/tenants/acme/policy", headers=viewer, json={}).status_code == 403
    assert client.post("/api/v1/keys", headers=viewer, json={"name": "x", "role": "admin"}).status_code == 403


def test_approver_cannot_administer(client, make_key):
    approver = make_key("approver")
    assert client.post("/api/v1/versions/1/pin", headers=approver, json={"reason": "hold"}).status_code == 403
    assert client.get("/api/v1/keys", headers=approver).status_code == 403
    # ...but may approve (404 here: the version does not exist, the role check passed).
    assert client.post("/api/v1/versions/1/approve", headers=approver, json={}).status_code == 404


def test_auditor_sees_only_its_tenants(client, admin, make_key):
    for tenant in ("acme", "globex"):
        assert client.put(f"/api/v1/tenants/{tenant}/policy", headers=admin, json={"ttl_days": 7}).status_code == 200
        r = client.post("/api/v1/deletion-requests", headers=admin,
                        json={"tenant_id": tenant, "scope": "tenant", "reason": "customer left"})
        assert r.status_code == 201
    globex_request = r.json()["id"]
    auditor = make_key("auditor", tenants=["acme"])

    assert client.get("/api/v1/tenants/acme/policy", headers=auditor).status_code == 200
    r = client.get("/api/v1/tenants/globex/policy", headers=auditor)
    assert r.status_code == 403 and "not scoped to tenant 'globex'" in r.json()["message"]
    assert [t["tenant_id"] for t in client.get("/api/v1/tenants", headers=auditor).json()] == ["acme"]
    assert client.get(f"/api/v1/deletion-requests/{globex_request}", headers=auditor).status_code == 403
    assert client.get("/api/v1/deletion-requests?tenant_id=globex", headers=auditor).status_code == 403
    assert {d["tenant_id"] for d in client.get("/api/v1/deletion-requests", headers=auditor).json()} == {"acme"}
    assert client.get("/api/v1/audit?tenant_id=globex", headers=auditor).status_code == 403
    entries = client.get("/api/v1/audit", headers=auditor).json()
    assert entries and {e["tenant_id"] for e in entries} == {"acme"}
    assert client.get("/api/v1/audit/verify", headers=auditor).json()["ok"] is True
    # Read-only and tenant-bound: no fleet-wide data, no writes.
    assert client.get("/api/v1/versions", headers=auditor).status_code == 403
    assert client.get("/api/v1/nodes", headers=auditor).status_code == 403
    assert client.put("/api/v1/tenants/acme/policy", headers=auditor, json={}).status_code == 403


def test_node_key_speaks_only_for_its_node(client, make_key):
    node = make_key("node", node_id="node-a")
    hb = {"served_version": None, "url": "http://127.0.0.1:8000", "live_tau": 1.0}
    assert client.post("/api/v1/nodes/node-a/heartbeat", headers=node, json=hb).status_code == 200
    assert client.post("/api/v1/nodes/node-b/heartbeat", headers=node, json=hb).status_code == 403
    assert client.get("/api/v1/nodes/node-a/desired", headers=node).status_code == 200
    assert client.get("/api/v1/nodes/node-b/desired", headers=node).status_code == 403
    assert client.get("/api/v1/tenants/acme/policy", headers=node).status_code == 200
    assert client.get("/api/v1/versions", headers=node).status_code == 403
    assert client.get("/api/v1/audit", headers=node).status_code == 403


def test_revoked_and_expired_keys_are_refused(client, admin, make_key):
    viewer = make_key("viewer")
    key_id = viewer["Authorization"].split("_")[1]
    assert client.delete(f"/api/v1/keys/{key_id}", headers=admin).status_code == 200
    r = client.get("/api/v1/whoami", headers=viewer)
    assert r.status_code == 401 and r.json()["message"] == "API key revoked"
    r = client.post("/api/v1/keys", headers=admin,
                    json={"name": "old", "role": "viewer", "expires_at": "2020-01-01T00:00:00Z"})
    old = {"Authorization": f"Bearer {r.json()['key']}"}
    assert client.get("/api/v1/whoami", headers=old).json()["message"] == "API key expired"
    # Right id, wrong secret.
    forged = {"Authorization": f"Bearer adf_{key_id}_{'x' * 43}"}
    assert client.get("/api/v1/whoami", headers=forged).json()["message"] == "invalid API key"


def test_last_admin_key_cannot_be_revoked(client, admin):
    key_id = admin["Authorization"].split("_")[1]
    r = client.delete(f"/api/v1/keys/{key_id}", headers=admin)
    assert r.status_code == 409 and "last active admin" in r.json()["message"]


def test_key_rules(client, admin):
    r = client.post("/api/v1/keys", headers=admin, json={"name": "a", "role": "auditor"})
    assert r.status_code == 422 and "at least one tenant" in r.json()["message"]
    r = client.post("/api/v1/keys", headers=admin, json={"name": "a", "role": "viewer", "tenants": ["acme"]})
    assert r.status_code == 422
    listed = client.get("/api/v1/keys", headers=admin).json()
    assert listed and all("key" not in k and "secret_hash" not in k for k in listed)


def test_admin_token_file(tmp_path, caplog):
    settings = load_config(home=tmp_path / "home")
    with caplog.at_level(logging.DEBUG):
        create_app(settings)
    path = settings.home / "admin-token"
    token = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token.startswith("adf_") and token not in caplog.text
    create_app(settings)  # a restart keeps the key
    assert path.read_text().strip() == token


@pytest.fixture
def jwt_client(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_JWT_SECRET", SECRET)
    settings = load_config(home=tmp_path / "home", controlplane={
        "jwt_issuer": "https://idp.example", "jwt_audience": "adaflash", "jwt_secret_env": "TEST_JWT_SECRET"})
    with TestClient(create_app(settings)) as c:
        yield c


def _token(secret: str = SECRET, **over):
    """Bearer headers with an HS256 token; a claim set to None is left out."""
    claims = {"iss": "https://idp.example", "aud": "adaflash", "sub": "alice", "role": "approver",
              "exp": int(time.time()) + 300, **over}
    token = jwt.encode({k: v for k, v in claims.items() if v is not None}, secret, algorithm="HS256")
    return {"Authorization": f"Bearer {token}"}


def test_jwt_bearer(jwt_client):
    r = jwt_client.get("/api/v1/whoami", headers=_token())
    assert r.status_code == 200 and r.json()["actor"] == "jwt:alice" and r.json()["role"] == "approver"
    auditor = _token(role="auditor", tenants=["acme"])
    assert jwt_client.get("/api/v1/tenants/globex/policy", headers=auditor).status_code == 403
    for bad, why in [(_token(iss="https://evil.example"), "issuer"), (_token(aud="other"), "audience"),
                     (_token(exp=int(time.time()) - 3600), "expired"), (_token(secret="another-secret-of-sufficient-length-0123"), "signature"),
                     (_token(role="root"), "role"), (_token(role=None), "role"), (_token(exp=None), "exp")]:
        r = jwt_client.get("/api/v1/whoami", headers=bad)
        assert r.status_code == 401, why
    unsigned = jwt.encode({"iss": "https://idp.example", "aud": "adaflash", "sub": "x", "role": "admin",
                           "exp": int(time.time()) + 300}, None, algorithm="none")
    assert jwt_client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {unsigned}"}).status_code == 401


def test_jwt_refused_when_not_configured(client):
    r = client.get("/api/v1/whoami", headers=_token())
    assert r.status_code == 401 and "not configured" in r.json()["message"]


def test_jwt_issuer_without_secret_fails_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_SECRET", raising=False)
    settings = load_config(home=tmp_path / "h", controlplane={"jwt_issuer": "x", "jwt_secret_env": "NO_SUCH_SECRET"})
    with pytest.raises(RuntimeError, match="NO_SUCH_SECRET"):
        create_app(settings)
