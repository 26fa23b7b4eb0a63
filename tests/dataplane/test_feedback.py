"""Feedback records are built off the engine thread from the finished request's envelope,
and the engine's sequence carries no request envelope fields."""

from __future__ import annotations

import threading
import time
from dataclasses import fields

import httpx

from dataplane.envelope import RequestEnvelope
from dataplane.feedback import FeedbackBuilder, FinishedRequest
from dataplane.sequence import Sequence


class _Capture:
    """The emitter's place: keeps each record with the thread that handed it over."""

    def __init__(self):
        self.items = []

    def submit(self, record, traceparent=None):
        self.items.append((record, traceparent, threading.current_thread().name))
        return True

    def close(self, timeout=None):
        return True


def test_sequence_holds_engine_state_only():
    names = {f.name for f in fields(Sequence)}
    assert not names & {f.name for f in fields(RequestEnvelope)}
    assert not names & {"prompt_text", "domain", "traceparent", "on_update"}


def test_records_are_built_off_the_engine_thread(server, tiny_node):
    cap = _Capture()
    tiny_node.emitter = cap
    try:
        r = httpx.post(f"{server.url}/v1/completions", headers={"X-Tenant-ID": "acme"}, timeout=60,
                       json={"prompt": "Hello, my name is", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                             "domain": "chat"})
        assert r.status_code == 200, r.text
        assert tiny_node.feedback.drain(10)
    finally:
        tiny_node.emitter = None
    (rec, traceparent, thread), = [x for x in cap.items if x[0].request_id == r.json()["id"]]
    assert thread == "feedback-builder" != tiny_node.engine._thread.name
    assert (rec.tenant_id, rec.domain, rec.prompt_text) == ("acme", "chat", "Hello, my name is")
    assert rec.response_text == r.json()["choices"][0]["text"]
    spec = r.json()["usage"]["speculative"]
    assert len(rec.rounds) == spec["rounds"] and rec.stats.verify_tokens == spec["verified_tokens"]
    assert rec.drafter_version == spec["drafter_version"] and traceparent is None  # no telemetry here


def _done(i: int) -> FinishedRequest:
    return FinishedRequest(f"r{i}", "t", RequestEnvelope(prompt_text="p"), [1, 2], [], 0.0, 1.0, None)


def test_builder_drops_and_counts_rather_than_block():
    gate = threading.Event()
    emitted = []

    def build(done):
        gate.wait(10)
        if done.request_id == "r1":
            raise ValueError("a record that cannot be built")
        return done.request_id

    b = FeedbackBuilder(build, lambda rec, tp: emitted.append(rec), queue_size=2)
    t0 = time.perf_counter()
    accepted = [b.submit(_done(i)) for i in range(5)]  # one being built, two queued, two over
    assert time.perf_counter() - t0 < 1.0
    assert accepted.count(True) in (2, 3) and b.dropped == accepted.count(False)
    gate.set()
    assert b.close(10)
    assert "r1" not in emitted and b.dropped == accepted.count(False) + 1
    assert emitted == [f"r{i}" for i, ok in enumerate(accepted) if ok and i != 1]
