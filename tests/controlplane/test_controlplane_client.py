"""Where the operator CLI finds the control plane and its key, in the documented order."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from adaflash.config import load_config
from adaflash.controlplane_client import (
    TOKEN_ENV,
    URL_ENV,
    ControlPlaneClient,
    ControlPlaneError,
    resolve_token,
    resolve_url,
)
from adaflash.stack_state import proc_start_time


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(URL_ENV, raising=False)


def test_url_order_flag_env_running_stack_config(tmp_path, monkeypatch, clean_env):
    settings = load_config(home=tmp_path, controlplane={"host": "0.0.0.0", "port": 8123})
    assert resolve_url(settings) == "http://127.0.0.1:8123"  # nothing else: the configured listener
    settings.dataplane.controlplane_url = "http://cp.internal:8100"
    assert resolve_url(settings) == "http://cp.internal:8100"
    # a running embedded stack (its supervisor is alive: here, this very process)
    state = {"supervisor": {"pid": os.getpid(), "start_time": proc_start_time(os.getpid())}, "phase": "running",
             "processes": {}, "endpoints": {"controlplane_url": "http://127.0.0.1:45678"}}
    (tmp_path / "stack.json").write_text(json.dumps(state))
    assert resolve_url(settings) == "http://127.0.0.1:45678"
    # a stale state file of a stack that is gone is not believed
    state["supervisor"]["start_time"] = -1
    (tmp_path / "stack.json").write_text(json.dumps(state))
    assert resolve_url(settings) == "http://cp.internal:8100"
    monkeypatch.setenv(URL_ENV, "http://from-env:1")
    assert resolve_url(settings) == "http://from-env:1"
    assert resolve_url(settings, "http://flag:2") == "http://flag:2"


def test_token_order_env_then_admin_token_file(tmp_path, monkeypatch, clean_env):
    settings = load_config(home=tmp_path)
    with pytest.raises(ControlPlaneError) as e:
        resolve_token(settings)
    assert e.value.code == "no_credentials" and "admin-token" in e.value.message
    (tmp_path / "admin-token").write_text("adf_file_key\n")
    assert resolve_token(settings) == "adf_file_key"
    other = tmp_path / "elsewhere"
    other.write_text("adf_configured\n")
    settings.controlplane.admin_token_file = str(other)
    assert resolve_token(settings) == "adf_configured"
    monkeypatch.setenv(TOKEN_ENV, "adf_env_key")
    assert resolve_token(settings) == "adf_env_key"


def test_base_url_with_or_without_api_prefix():
    for url in ("http://cp:8100", "http://cp:8100/", "http://cp:8100/api/v1"):
        with ControlPlaneClient(url, "t") as c:
            assert c.base_url == "http://cp:8100" and str(c.http.base_url) == "http://cp:8100/api/v1/"


def _in_process(client) -> httpx.MockTransport:
    """An httpx transport that hands each request to the app's TestClient."""

    def forward(req: httpx.Request) -> httpx.Response:
        r = client.request(req.method, str(req.url), content=req.content, headers=dict(req.headers))
        return httpx.Response(r.status_code, headers={"content-type": r.headers.get("content-type", "")},
                              content=r.content)

    return httpx.MockTransport(forward)


def test_node_role_and_desired_version(client, admin):
    """PUT /nodes/{id} and GET /nodes/{id}/desired through the typed client (the app in-process)."""
    from adaflash.contracts.admin_api import HeartbeatIn

    token = admin["Authorization"].split(" ", 1)[1]
    with ControlPlaneClient("http://testserver", token, transport=_in_process(client)) as c:
        c.heartbeat("node-a", HeartbeatIn(url="http://a"))
        assert c.set_node_role("node-a", "canary").role == "canary"
        assert c.get_node("node-a").role == "canary"
        assert c.desired("node-a") is None  # no champion yet: keep serving what it has
        with pytest.raises(ControlPlaneError) as e:
            c.set_node_role("node-z", "regular")
        assert e.value.status == 404
