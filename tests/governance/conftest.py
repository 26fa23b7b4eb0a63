"""Fixtures for governance tests: a real Tansu broker, the real scrubber, record helpers."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

os.environ["TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS"] = ""

from adaflash.config import KafkaConfig  # noqa: E402
from adaflash.contracts.feedback import FeedbackRecord  # noqa: E402
from governance.broker import TansuBroker, ensure_topics  # noqa: E402

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_record(tenant: str = "acme", prompt: str = "hello", response: str = "world", **kw) -> FeedbackRecord:
    base = dict(tenant_id=tenant, node_id="node-1", request_id=kw.pop("request_id", "req"),
                target_model={"id": "SmolLM2-135M-Instruct", "sha256": "0" * 64}, drafter_version="v1",
                mode="adaptive", sampling={"temperature": 0.0, "top_p": 1.0}, prompt_text=prompt,
                response_text=response, rounds=[{"k_hat": 4, "accepted": 2, "a_hat": 0.5}],
                stats={"tau_mean": 2.0, "verify_tokens": 4, "draft_ms": 1.0, "verify_ms": 2.0})
    base.update(kw)
    return FeedbackRecord(**base)


def kafka_config(bootstrap: str) -> KafkaConfig:
    # short timeouts so outages are noticed within seconds
    return KafkaConfig(bootstrap=bootstrap, request_timeout_ms=2000, delivery_timeout_ms=4000, max_block_ms=2000)


def consume(bootstrap: str, topic: str, *, expect: int | None = None, timeout_s: float = 20.0,
            idle_s: float = 2.0, partitions: int = 4):
    """Read a topic from the beginning (no consumer group); stops at ``expect`` messages or idle."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
                      fetch_max_wait_ms=100, consumer_timeout_ms=int(idle_s * 1000))
    try:
        c.assign([TopicPartition(topic, p) for p in range(partitions)])
        c.seek_to_beginning()
        out = []
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            got = c.poll(timeout_ms=200)
            for msgs in got.values():
                out.extend(msgs)
            if got:
                last = time.monotonic()
            if expect is not None and len(out) >= expect:
                break
            if expect is None and time.monotonic() - last > idle_s:
                break
        return out
    finally:
        c.close()


@pytest.fixture(scope="session")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


@pytest.fixture()
def fresh_broker(tmp_path) -> Iterator[TansuBroker]:
    with TansuBroker(log_path=tmp_path / "tansu.log") as b:
        yield b


@pytest.fixture()
def topics(broker):
    """A unique pair of topics on the session broker for one test."""
    import uuid

    suffix = uuid.uuid4().hex[:8]
    kc = kafka_config(broker.bootstrap).model_copy(update={
        "feedback_topic": f"t{suffix}.feedback.v1", "dlq_topic": f"t{suffix}.feedback.dlq.v1"})
    ensure_topics(broker.bootstrap, kc, 3_600_000)
    return kc


@pytest.fixture(scope="session")
def scrubber():
    """The real scrubber, built with every outbound connection refused (proves it is offline)."""
    from governance.pii import Scrubber

    real_connect = socket.socket.connect
    attempts = []

    def no_network(self, addr):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(addr)
            raise OSError("network disabled in this test")
        return real_connect(self, addr)

    socket.socket.connect = no_network
    try:
        s = Scrubber()
        s.scrub("warm up: John Smith, john@example.com, https://example.org")
    finally:
        socket.socket.connect = real_connect
    assert attempts == [], f"scrubber tried to reach the network: {attempts}"
    return s


def free_dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
