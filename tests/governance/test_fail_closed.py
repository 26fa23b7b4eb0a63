"""Fail closed, end to end: a node whose control plane is unreachable, refuses its token
(401) or answers malformed JSON serves every request and emits no feedback record for
any tenant (records are held, then dropped and counted as ``no_policy``). Once a valid
policy arrives, held records follow it: the opted-out tenant's are dropped, the other's
reach the real broker.

Real pieces: a tiny-target node over real HTTP, the emitter as ``build_emitter`` wires it
(HTTP policy source, real scrubber, spool, producer), a Tansu broker. The control plane
is a small HTTP server answering the policy endpoint the way each case needs; the key it
accepts is read by the node from a token file (not the environment).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from adaflash.config import load_config
from adaflash.contracts.feedback import FeedbackRecord
from tests.governance.conftest import consume, free_dead_port
from tests.stack.conftest import BLOCK, tiny_bundle, tiny_vocab_target  # noqa: F401 - fixtures

pytestmark = pytest.mark.services

GOOD_KEY = "node-key-good"
TENANTS = ("acme", "opted-out")
POLICIES = {"acme": {"tenant_id": "acme", "sampling_rate": 1.0, "opt_out": False, "ttl_days": 7, "share_cap": 0.5},
            "opted-out": {"tenant_id": "opted-out", "sampling_rate": 1.0, "opt_out": True, "ttl_days": 7,
                          "share_cap": 0.5}}


class _PolicyServer(BaseHTTPRequestHandler):
    mode = "ok"  # ok | malformed | refuse

    def do_GET(self):  # noqa: N802
        tenant = self.path.split("/")[4]
        if self.mode == "refuse" or self.headers.get("Authorization") != f"Bearer {GOOD_KEY}":
            return self._send(401, b'{"detail": "invalid API key"}')
        if self.mode == "malformed":
            return self._send(200, b'{"tenant_id": "acme", "sampling_rate": ')
        return self._send(200, json.dumps(POLICIES[tenant]).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def policy_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _PolicyServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_vocab_target, tiny_bundle):  # noqa: F811
    from dataplane.model import TargetModel
    from dataplane.node import Node
    from dataplane.server import create_app
    from dataplane.tokenizer import Tokenizer
    from tests.dataplane.conftest import LiveServer

    s = load_config(None, home=tmp_path_factory.mktemp("home"))
    s.model.path, s.model.max_model_len = str(tiny_vocab_target), 512
    s.dataplane.block_size, s.dataplane.drafter = BLOCK, str(tiny_bundle)
    node = Node(s, target=TargetModel.from_pretrained(tiny_vocab_target), tokenizer=Tokenizer(tiny_vocab_target),
                target_dir=tiny_vocab_target)
    node.engine.start()
    with LiveServer(create_app(node, "admin")) as live:
        yield node, live.url
    node.engine.stop()


def _attach(node, tmp_path, topics, cp_url: str, key: str, monkeypatch):
    from governance.emitter import build_emitter

    monkeypatch.delenv("ADAFLASH_NODE_TOKEN", raising=False)
    token_file = tmp_path / "node-token"
    token_file.write_text(key + "\n")
    token_file.chmod(0o600)
    s = load_config(None, home=tmp_path / "home")
    s.kafka = topics
    s.dataplane.controlplane_url = cp_url
    s.dataplane.controlplane_token_file = str(token_file)
    s.governance = s.governance.model_copy(update={"scrubber": "inline", "policy_retry_s": 0.2,
                                                   "policy_timeout_s": 1.0, "scrub_timeout_s": 30.0})
    node.emitter = build_emitter(s)
    return node.emitter


def _serve(url: str, n: int) -> list[str]:
    """n chat requests alternating the tenants; every one must be served."""
    texts = []
    for i in range(n):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Tenant-ID": TENANTS[i % 2]},
                       json={"messages": [{"role": "user", "content": f"Hi, my name is Zofia Kowalska-Nowak {i}"}],
                             "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    return texts


def _wait(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("case", ["unreachable", "refused", "malformed"])
def test_unknown_policy_serves_everything_and_emits_nothing(case, served, policy_server, broker, topics, tmp_path,
                                                            monkeypatch):
    node, url = served
    srv, cp_url = policy_server
    _PolicyServer.mode = {"refused": "refuse", "malformed": "malformed"}.get(case, "ok")
    if case == "unreachable":
        cp_url = f"http://127.0.0.1:{free_dead_port()}"
    em = _attach(node, tmp_path, topics, cp_url, GOOD_KEY, monkeypatch)
    try:
        n = 6
        _serve(url, n)
        assert _wait(lambda: em.counters()["held"] == n), em.counters()
        assert em.counters()["emitted"] == {}
    finally:
        node.emitter = None
        em.close(timeout=10)
    c = em.counters()
    assert c["emitted"] == {} and c["held"] == 0
    assert c["dropped"] == {t: {"no_policy": n // 2} for t in TENANTS}
    assert em.registry.get_sample_value("adaflash_feedback_dropped_total",
                                        {"tenant": "opted-out", "reason": "no_policy"}) == n // 2
    assert consume(broker.bootstrap, topics.feedback_topic, idle_s=1.0) == []


def test_held_records_follow_the_policy_once_the_control_plane_answers(served, policy_server, broker, topics,
                                                                       tmp_path, monkeypatch):
    node, url = served
    srv, cp_url = policy_server
    _PolicyServer.mode = "refuse"
    em = _attach(node, tmp_path, topics, cp_url, GOOD_KEY, monkeypatch)
    try:
        _serve(url, 4)
        assert _wait(lambda: em.counters()["held"] == 4), em.counters()
        _PolicyServer.mode = "ok"  # the control plane accepts the node's key again
        assert _wait(lambda: em.counters()["held"] == 0), em.counters()
        _serve(url, 2)  # now known: emitted at once
        assert _wait(lambda: sum(em.counters()["submitted"].values()) == 6)  # finish hooks ran
        assert em.drain(30) and em.sink.flush(30)
        c = em.counters()
    finally:
        node.emitter = None
        em.close(timeout=10)
    assert c["emitted"] == {"acme": 3}
    assert c["dropped"] == {"opted-out": {"opt_out": 3}}
    got = [FeedbackRecord.from_bytes(m.value) for m in consume(broker.bootstrap, topics.feedback_topic, expect=3)]
    assert sorted(r.tenant_id for r in got) == ["acme"] * 3
    for r in got:
        assert "Kowalska" not in r.prompt_text and "Zofia" not in r.prompt_text, r.prompt_text
