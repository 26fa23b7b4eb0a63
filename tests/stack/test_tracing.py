"""OpenTelemetry across the services, read back through in-memory exporters."""

from __future__ import annotations

import time

import httpx
import pytest

from adaflash.config import load_config
from adaflash.telemetry import (
    CONTROLPLANE,
    DATAPLANE,
    Metrics,
    Spans,
    extract_context,
    reset_telemetry,
    setup_telemetry,
)
from tests.stack.conftest import BLOCK


class _Capture:
    """Stands in for the governance emitter: keeps what the node submits."""

    def __init__(self):
        self.items = []

    def submit(self, record, traceparent=None):
        self.items.append((record, traceparent))
        return True

    def close(self):
        pass


@pytest.fixture(scope="module")
def traced_node(tmp_path_factory, tiny_vocab_target, tiny_bundle):
    from dataplane.model import TargetModel
    from dataplane.node import Node
    from dataplane.server import create_app
    from dataplane.tokenizer import Tokenizer
    from tests.dataplane.conftest import LiveServer

    home = tmp_path_factory.mktemp("home")
    settings = load_config(home=home)
    settings.model.path = str(tiny_vocab_target)
    settings.model.max_model_len = 512
    settings.dataplane.block_size = BLOCK
    settings.dataplane.drafter = str(tiny_bundle)
    settings.telemetry.exporter = "memory"
    tel = setup_telemetry(DATAPLANE, settings)
    node = Node(settings, target=TargetModel.from_pretrained(tiny_vocab_target), tokenizer=Tokenizer(tiny_vocab_target),
                target_dir=tiny_vocab_target)
    node.emitter = _Capture()
    node.engine.start()
    with LiveServer(create_app(node, "tok")) as srv:
        yield tel, node, srv
    node.engine.stop()
    reset_telemetry()


def _spans_of(tel, trace_id):
    return [s for s in tel.finished_spans() if s.context.trace_id == trace_id]


def _wait_root(tel, request_id, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in tel.finished_spans():
            if s.name == Spans.REQUEST and s.attributes.get("request_id") == request_id:
                return s
        time.sleep(0.05)
    raise AssertionError(f"no request span for {request_id}")


@pytest.mark.parametrize("stream", [False, True])
def test_request_span_tree_and_feedback_traceparent(traced_node, stream):
    tel, node, srv = traced_node
    body = {"prompt": "Write a haiku about the sea.", "max_tokens": 24, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{srv.url}/v1/completions", json=body, headers={"X-Tenant-ID": "acme"})
        assert r.status_code == 200
        if stream:
            rid = next(line for line in r.text.splitlines() if line.startswith("data: {"))
            import json

            rid = json.loads(rid[6:])["id"]
        else:
            rid = r.json()["id"]
    root = _wait_root(tel, rid)
    assert root.parent is None and root.attributes["tenant"] == "acme"
    assert root.attributes["completion_tokens"] == 24 and root.attributes["http.response.status_code"] == 200
    spans = _spans_of(tel, root.context.trace_id)
    kids = [s for s in spans if s.parent is not None]
    assert all(s.parent.span_id == root.context.span_id for s in kids)
    names = [s.name for s in kids]
    assert names.count(Spans.QUEUE) == 1 and names.count(Spans.PREFILL) == 1
    rounds = sorted((s for s in kids if s.name == Spans.SPEC_ROUND), key=lambda s: s.attributes["round"])
    assert len(rounds) == root.attributes["rounds"] >= 1
    # the prefill made the first token; the last round may accept more than max_tokens leaves room for
    made = [s.attributes["accepted"] + 1 for s in rounds]
    assert sum(made[:-1]) < 24 - 1 <= sum(made)
    for s in rounds:
        assert 1 <= s.attributes["k_hat"] <= BLOCK and 0 <= s.attributes["accepted"] < s.attributes["k_hat"]
    # children sit inside the request, in order: queue -> prefill -> rounds
    q = next(s for s in kids if s.name == Spans.QUEUE)
    p = next(s for s in kids if s.name == Spans.PREFILL)
    assert root.start_time <= q.start_time <= q.end_time <= p.start_time + 1000 <= p.end_time + 1000
    assert p.end_time <= rounds[0].end_time <= rounds[-1].end_time <= root.end_time
    # the feedback record carries the request's traceparent (it goes into the Kafka headers)
    deadline = time.monotonic() + 10  # the engine hands the record over just after the last token
    while time.monotonic() < deadline and not [1 for rec, _ in node.emitter.items if rec.request_id == rid]:
        time.sleep(0.05)
    rec, tp = next((rec, tp) for rec, tp in node.emitter.items if rec.request_id == rid)
    from opentelemetry import trace

    sc = trace.get_current_span(extract_context(tp)).get_span_context()
    assert sc.trace_id == root.context.trace_id and sc.span_id == root.context.span_id


def test_latency_histograms_per_tenant(traced_node):
    tel, node, srv = traced_node
    for tenant in ("t-one", "t-two"):
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True},
                       headers={"X-Tenant-ID": tenant}, timeout=60)
        assert r.status_code == 200
        _wait_root(tel, r.json()["id"])
    data = tel.metrics_data()
    seen: dict[str, dict[str, int]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    seen.setdefault(m.name, {})[dp.attributes.get("tenant")] = dp.count
    for name in (Metrics.TTFT, Metrics.E2E_LATENCY):
        assert seen[name]["t-one"] >= 1 and seen[name]["t-two"] >= 1
    assert seen[Metrics.INTER_TOKEN_LATENCY]["t-one"] >= 7  # every token after the first


def test_errors_are_traced_without_a_sequence(traced_node):
    tel, _, srv = traced_node
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=10)
    assert r.status_code == 400
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        bad = [s for s in tel.finished_spans()
               if s.name == Spans.REQUEST and s.attributes.get("http.response.status_code") == 400]
        if bad:
            break
        time.sleep(0.05)
    assert bad and not [s for s in tel.finished_spans() if s.parent and s.parent.span_id == bad[0].context.span_id]


@pytest.fixture
def cp_memory(tmp_path):
    settings = load_config(home=tmp_path / "home")
    settings.telemetry.exporter = "memory"
    tel = setup_telemetry(CONTROLPLANE, settings)
    yield settings, tel
    reset_telemetry()


def test_controlplane_api_spans(cp_memory):
    from fastapi.testclient import TestClient

    from controlplane.api import create_app

    settings, tel = cp_memory
    app = create_app(settings)
    admin = {"Authorization": f"Bearer {(settings.home / 'admin-token').read_text().strip()}"}
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with TestClient(app) as c:
        assert c.get("/api/v1/versions", headers={**admin, "traceparent": caller}).status_code == 200
        assert c.get("/api/v1/versions/nope", headers=admin).status_code == 404
    spans = tel.finished_spans()
    listing = next(s for s in spans if s.name == "GET /api/v1/versions")
    assert listing.attributes["http.response.status_code"] == 200
    assert listing.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)  # continues the caller
    missing = next(s for s in spans if s.attributes.get("http.route") == "/api/v1/versions/{version}")
    assert missing.attributes["http.response.status_code"] == 404
