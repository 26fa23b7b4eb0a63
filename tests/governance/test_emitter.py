import threading
import time

import pytest

from adaflash.config import GovernanceConfig
from adaflash.contracts.tenancy import TenantPolicy
from governance.emitter import FeedbackEmitter, sampled
from governance.pii import ScrubbedRecord, ScrubError
from governance.policy import StaticPolicySource
from tests.governance.conftest import make_record


class ListSink:
    def __init__(self):
        self.got: list[tuple[ScrubbedRecord, str | None]] = []

    def send(self, record, traceparent=None):
        assert isinstance(record, ScrubbedRecord)
        self.got.append((record, traceparent))
        return True


class FlakyScrubber:
    """Raises on 'BOOM', hangs on 'HANG' (until released), else marks the text scrubbed."""

    def __init__(self):
        self.release = threading.Event()

    def scrub_record(self, record):
        if "BOOM" in record.prompt_text:
            raise ScrubError("scrubbing failed: ValueError")
        if "HANG" in record.prompt_text:
            self.release.wait(30)
        return ScrubbedRecord(record.model_copy(update={"prompt_text": "<SCRUBBED>", "response_text": "<SCRUBBED>"}))


def test_scrubber_that_raises_or_hangs_drops_and_emitter_keeps_working():
    sink, scr = ListSink(), FlakyScrubber()
    em = FeedbackEmitter(sink, scr, workers=1, scrub_timeout_s=0.3)
    try:
        assert em.submit(make_record(prompt="ok 1"))
        assert em.submit(make_record(prompt="BOOM secret-canary-1"))
        assert em.submit(make_record(prompt="HANG secret-canary-2"))
        assert em.submit(make_record(prompt="ok 2"))
        assert em.drain(10)
        c = em.counters()
        assert c["dropped"]["acme"] == {"scrub_error": 1, "scrub_timeout": 1}
        assert c["emitted"]["acme"] == 2
        assert [r.record.prompt_text for r, _ in sink.got] == ["<SCRUBBED>", "<SCRUBBED>"]
        # more records after the hang: still flowing
        for i in range(5):
            assert em.submit(make_record(prompt=f"ok {i}"))
        assert em.drain(10)
        assert em.counters()["emitted"]["acme"] == 7
    finally:
        scr.release.set()
        em.close()


def test_submit_never_blocks_and_counts_queue_full():
    gate = threading.Event()

    class SlowScrubber:
        def scrub_record(self, record):
            gate.wait(10)
            return ScrubbedRecord(record)

    em = FeedbackEmitter(ListSink(), SlowScrubber(), workers=1, queue_size=5, scrub_timeout_s=30)
    try:
        t0 = time.perf_counter()
        results = [em.submit(make_record(tenant="busy")) for _ in range(50)]
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.5
        assert results.count(True) <= 6 + 1
        c = em.counters()
        assert c["dropped"]["busy"]["queue_full"] == results.count(False) > 0
    finally:
        gate.set()
        em.close()


def test_opt_out_and_sampling_rate():
    pol = StaticPolicySource({
        "gone": TenantPolicy(tenant_id="gone", opt_out=True),
        "half": TenantPolicy(tenant_id="half", sampling_rate=0.5),
        "none": TenantPolicy(tenant_id="none", sampling_rate=0.0),
    })
    sink = ListSink()

    class Boom:
        def scrub_record(self, record):
            if record.tenant_id == "gone":
                raise AssertionError("an opted-out tenant's text must not even be scrubbed")
            return ScrubbedRecord(record)

    em = FeedbackEmitter(sink, Boom(), pol, workers=2, queue_size=2000)
    recs = {t: [make_record(tenant=t) for _ in range(400)] for t in ("gone", "half", "none", "other")}
    for rs in recs.values():
        for r in rs:
            assert em.submit(r)
    assert em.drain(20)
    em.close()
    c = em.counters()
    by_tenant = {}
    for r, _ in sink.got:
        by_tenant[r.tenant_id] = by_tenant.get(r.tenant_id, 0) + 1
    assert "gone" not in by_tenant and c["dropped"]["gone"] == {"opt_out": 400}
    assert "none" not in by_tenant
    assert by_tenant["other"] == 400
    expected = sum(sampled(r.record_id, 0.5) for r in recs["half"])
    assert by_tenant["half"] == expected and 150 < expected < 250
    assert c["dropped"]["half"]["sampled_out"] == 400 - expected


def test_invalid_tenant_and_metrics_labels():
    from prometheus_client import generate_latest

    em = FeedbackEmitter(ListSink(), FlakyScrubber(), workers=1, scrub_timeout_s=1)
    # the contract refuses such an id; a record built around it must still be refused here
    bad = make_record().model_copy(update={"tenant_id": "John Smith <john@example.com>"})
    assert em.submit(bad) is False
    assert em.submit(make_record(prompt="BOOM Margaret Thompson"))
    assert em.drain(5)
    em.close()
    text = generate_latest(em.registry).decode()
    assert "john@example.com" not in text and "Thompson" not in text
    assert 'adaflash_feedback_dropped_total{reason="invalid_tenant",tenant="_invalid"} 1.0' in text
    assert 'adaflash_feedback_dropped_total{reason="scrub_error",tenant="acme"} 1.0' in text
    assert em.counters()["dropped"]["_invalid"] == {"invalid_tenant": 1}
    assert em.submit(make_record()) is False  # closed


def test_policy_source_failure_holds_then_drops_never_defaults():
    class Broken:
        def get(self, tenant_id):
            raise RuntimeError("down")

    sink = ListSink()
    em = FeedbackEmitter(sink, FlakyScrubber(), Broken(), workers=1)
    assert em.submit(make_record())
    assert em.drain(5)
    assert em.counters()["held"] == 1
    em.close()
    assert sink.got == []
    assert em.counters()["dropped"] == {"acme": {"no_policy": 1}}


def test_held_records_follow_the_policy_once_known():
    class Flipping:
        """No policy until ``known`` is set; then acme is opted out, beta samples all."""

        def __init__(self):
            self.known = threading.Event()

        def get(self, tenant_id):
            if not self.known.is_set():
                return None
            return TenantPolicy(tenant_id=tenant_id, opt_out=tenant_id == "acme")

    src = Flipping()
    sink = ListSink()
    em = FeedbackEmitter(sink, FlakyScrubber(), src, gov=GovernanceConfig(policy_retry_s=0.05, policy_hold_max=3),
                         workers=1)
    for i in range(4):
        assert em.submit(make_record(tenant="acme" if i % 2 else "beta", request_id=str(i)))
    assert em.drain(5)
    c = em.counters()
    assert c["held"] == 3 and c["emitted"] == {} and sink.got == []
    assert c["dropped"] == {"acme": {"no_policy": 1}}  # no room: the fourth is dropped
    src.known.set()
    deadline = time.monotonic() + 10
    while em.counters()["held"] and time.monotonic() < deadline:
        time.sleep(0.02)
    em.close()
    c = em.counters()
    assert c["held"] == 0
    assert [r.tenant_id for r, _ in sink.got] == ["beta", "beta"]
    assert c["dropped"] == {"acme": {"no_policy": 1, "opt_out": 1}}


def test_held_records_expire():
    sink = ListSink()

    class Unknown:
        def get(self, tenant_id):
            return None

    em = FeedbackEmitter(sink, FlakyScrubber(), Unknown(),
                         gov=GovernanceConfig(policy_retry_s=0.05, policy_hold_s=0.2), workers=1)
    assert em.submit(make_record())
    deadline = time.monotonic() + 10
    while not em.counters()["dropped"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert em.counters()["dropped"] == {"acme": {"no_policy": 1}} and em.counters()["held"] == 0
    em.close()
    assert sink.got == []


def test_purge_tenant_drops_queued_records():
    gate = threading.Event()

    class Wait:
        def scrub_record(self, record):
            gate.wait(10)
            return ScrubbedRecord(record)

    sink = ListSink()
    em = FeedbackEmitter(sink, Wait(), workers=1, queue_size=100, scrub_timeout_s=30)
    for i in range(10):
        em.submit(make_record(tenant="del" if i % 2 else "keep"))
    time.sleep(0.2)
    n = em.purge_tenant("del")
    gate.set()
    assert em.drain(10)
    em.close()
    assert n >= 4
    assert em.counters()["dropped"]["del"]["deleted"] == n
    assert sum(1 for r, _ in sink.got if r.tenant_id == "del") == 5 - n


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_sampling_is_deterministic(rate):
    ids = [f"id{i}" for i in range(2000)]
    a = [sampled(i, rate) for i in ids]
    assert a == [sampled(i, rate) for i in ids]
    assert abs(sum(a) / len(a) - rate) < 0.05
