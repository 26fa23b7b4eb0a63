"""The node's HTTP surface over real HTTP: OpenAI-compatible answers, errors, admin, metrics."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from dataplane.drafter import new_drafter
from dataplane.drafter_io import save_bundle
from tests.dataplane.conftest import TOKEN


def test_completion_and_usage(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello there", "max_tokens": 12,
                                                          "temperature": 0, "ignore_eos": True},
                   headers={"X-Tenant-ID": "acme"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    spec = body["usage"]["speculative"]
    assert body["usage"]["completion_tokens"] == 12
    assert set(spec) == {"rounds", "draft_tokens", "verified_tokens", "accepted_tokens", "mean_accept_len",
                         "mean_verify_len", "drafter_version"}
    assert spec["drafter_version"] == "v1" and spec["rounds"] >= 1


def test_chat_streaming_matches_non_streaming(server):
    req = {"messages": [{"role": "user", "content": "Count to five"}], "max_tokens": 16, "temperature": 0,
           "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=req, timeout=60).json()
    text = plain["choices"][0]["message"]["content"]
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**req, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert streamed == text
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16


def test_stop_string_is_honoured(server):
    base = {"prompt": "a b c", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{server.url}/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]
    r = httpx.post(f"{server.url}/v1/completions", json={**base, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["text"] == full[: full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "empty"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": ""}).encode(), 400, "empty"),
    (json.dumps({"prompt": "hi", "temperature": 5}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 100}).encode(), 400, "n"),
    (json.dumps({"prompt": "word " * 400}).encode(), 400, "at most"),
])
def test_bad_input_gets_json_4xx(server, body, status, fragment):
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert fragment in r.json()["error"]["message"]


def test_bad_tenant_and_unknown_route(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers={"X-Tenant-ID": "bad tenant!"})
    assert r.status_code == 400 and "X-Tenant-ID" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/nope").status_code == 404


def test_health_ready_metrics(server, tiny_node):
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz")
    assert ready.status_code == 200 and ready.json()["drafter_version"] == "v1"
    assert ready.json()["dtype"] == str(tiny_node.target.lm_head.weight.dtype).removeprefix("torch.")
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("adaflash_tps", "adaflash_tau", "adaflash_k_hat", "adaflash_position_verified",
                 "adaflash_queue_depth", 'adaflash_drafter_info{version="v1"}'):
        assert name in text


def test_admin_requires_token_and_refuses_bad_weights(server, tiny_node, tmp_path):
    assert httpx.get(f"{server.url}/admin/drafter").status_code == 401
    assert httpx.get(f"{server.url}/admin/drafter", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{server.url}/admin/drafter", headers=auth).json()["version"] == "v1"
    from dataplane.target_cache import target_identity

    good = tmp_path / "v2"
    save_bundle(new_drafter(tiny_node.target, seed=2, num_layers=1, n_target_layers=2, block_size=8), good,
                target_identity(tiny_node.target_dir), version="v2")
    bad = tmp_path / "bad"
    save_bundle(new_drafter(tiny_node.target, seed=3, num_layers=1, n_target_layers=2, block_size=8), bad,
                target_identity(tiny_node.target_dir), version="bad")
    raw = bytearray((bad / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(raw))
    r = httpx.post(f"{server.url}/admin/drafter", json={"version": "bad", "uri": str(bad)}, headers=auth, timeout=60)
    assert r.status_code == 409 and "sha256 mismatch" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/admin/drafter", headers=auth).json()["version"] == "v1"
    r = httpx.post(f"{server.url}/admin/drafter", json={"version": "v2", "uri": str(good)}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["pause_ms"] < 50
    assert httpx.get(f"{server.url}/admin/drafter", headers=auth).json()["version"] == "v2"
    done = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
    assert done.json()["usage"]["speculative"]["drafter_version"] == "v2"
    r = httpx.post(f"{server.url}/admin/drafter", json={"version": "x"}, headers=auth)
    assert r.status_code == 400


def test_admin_load_from_a_server_without_a_bundle_is_409(server):
    """An http(s) URI whose server answers but serves no artifact directory is refused with
    the reason, as JSON, and the node keeps serving what it had."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = httpx.get(f"{server.url}/admin/drafter", headers=auth).json()["version"]
    r = httpx.post(f"{server.url}/admin/drafter", json={"version": "x", "uri": f"{server.url}/no/such/bundle"},
                   headers=auth, timeout=60)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "drafter_refused" and err["param"] == "uri"
    assert "serves no MLflow artifact directory" in err["message"] and f"still serving {before}" in err["message"]
    assert httpx.get(f"{server.url}/admin/drafter", headers=auth).json()["version"] == before


def test_admin_lists_the_requests_in_flight(server, tiny_node, monkeypatch):
    """GET /admin/requests: each completion in flight with its stage and where the engine
    holds it; a stream stays listed until its last byte, an answered request is gone."""
    url, auth = server.url, {"Authorization": f"Bearer {TOKEN}"}
    # The tiny target can finish 40 tokens before the listing is read: the engine takes one
    # step with work, then waits until the listing has been checked.
    engine, stepped, release = tiny_node.engine, threading.Event(), threading.Event()
    step = engine.step

    def one_step_then_wait() -> bool:
        if stepped.is_set():
            release.wait(30)
        busy = step()
        if busy:
            stepped.set()
        return busy

    monkeypatch.setattr(engine, "step", one_step_then_wait)
    assert httpx.get(f"{url}/admin/requests").status_code == 401
    assert httpx.get(f"{url}/admin/requests", headers=auth).json()["requests"] == []
    req = {"messages": [{"role": "user", "content": "Count to fifty"}], "max_tokens": 40, "temperature": 0,
           "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=req, headers={"X-Tenant-ID": "acme"},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        listed = httpx.get(f"{url}/admin/requests", headers=auth).json()["requests"]
        assert [(x["path"], x["tenant"], x["stage"]) for x in listed] == [("/v1/chat/completions", "acme",
                                                                           "generating")]
        assert listed[0]["id"].startswith("chatcmpl-") and listed[0]["choices"][0]["engine_status"] == "running"
        release.set()
        list(lines)  # read the stream to its end
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60).status_code == 200
    assert httpx.get(f"{url}/admin/requests", headers=auth).json()["requests"] == []
