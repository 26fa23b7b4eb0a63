"""PII canaries through the whole path: emitter -> scrubber -> spool -> broker -> consumer.

Phase 1 runs with the broker unreachable, so every record lands in the spool; phase 2
points a producer at the real broker, which replays the spool. The topic (keys, values,
headers), the spool and usage database files (with their WAL files) and the logs are
scanned for every planted raw value.
"""

import logging
from pathlib import Path

from adaflash.contracts.feedback import FeedbackRecord
from governance.emitter import FeedbackEmitter
from governance.producer import FeedbackProducer
from governance.spool import Spool
from governance.usage_audit import UsageAudit
from tests.governance.canaries import ALL_RAW, CANARIES
from tests.governance.conftest import TRACEPARENT, consume, free_dead_port, kafka_config, make_record


def _leaks(blob: bytes) -> list[str]:
    return [raw for raw in ALL_RAW if raw.encode() in blob]


def _files(*paths: Path) -> bytes:
    out = b""
    for p in paths:
        for f in p.parent.glob(p.name + "*"):  # db, -wal, -shm
            out += f.read_bytes()
    return out


def test_pii_canaries_never_leave_the_node(broker, topics, scrubber, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, the most talkative level
    prompts = [text for _, text, _ in CANARIES]
    records = [make_record(tenant=f"tenant-{i % 3}", prompt=p, response=f"Sure, {p}", request_id=f"r{i}")
               for i, p in enumerate(prompts)]
    spool_path, usage_path = tmp_path / "spool.db", tmp_path / "usage.db"

    # phase 1: broker unreachable -> spool
    spool = Spool(spool_path, 1000)
    usage = UsageAudit(usage_path)
    for t in ("tenant-0", "tenant-1", "tenant-2"):
        usage.request_samples(t, keep=3)
    dead = f"127.0.0.1:{free_dead_port()}"
    down = FeedbackProducer(dead, spool, kafka_config(dead).model_copy(update={"feedback_topic": topics.feedback_topic}),
                            retention_ms=3_600_000, backoff_s=(0.1, 0.5))
    em = FeedbackEmitter(down, scrubber, usage=usage, workers=2, scrub_timeout_s=30)
    assert all(em.submit(r, TRACEPARENT) for r in records)
    assert em.drain(60)
    down.close(timeout=1)
    em.close()
    assert len(spool) == len(records)
    c = em.counters()
    assert sum(c["emitted"].values()) == len(records) and not c["dropped"]
    spool.close()
    usage.close()
    assert _leaks(_files(spool_path, usage_path)) == []

    # phase 2: broker back -> replay from the spool
    spool = Spool(spool_path, 1000)
    up = FeedbackProducer(broker.bootstrap, spool, topics, retention_ms=3_600_000)
    assert up.flush(30), up.stats()
    up.close()
    spool.close()
    msgs = consume(broker.bootstrap, topics.feedback_topic, expect=len(records))
    assert len(msgs) == len(records)
    blob = b"".join((m.key or b"") + m.value + b"".join(k.encode() + v for k, v in m.headers) for m in msgs)
    assert _leaks(blob) == []
    assert _leaks(caplog.text.encode()) == []
    assert _leaks(_files(spool_path, usage_path)) == []

    got = [FeedbackRecord.from_bytes(m.value) for m in msgs]
    assert {g.record_id for g in got} == {r.record_id for r in records}
    for m in msgs:
        assert m.key.decode() == FeedbackRecord.from_bytes(m.value).tenant_id
        assert dict(m.headers) == {"schema_version": b"1", "traceparent": TRACEPARENT.encode()}
    entities = {e for g in got for e in g.pii}
    assert {e for e, _, _ in CANARIES} <= entities

    usage = UsageAudit(usage_path)
    rep = usage.report()
    assert sum(r["emitted"] for r in rep) == len(records)
    assert sum(r["entities"].get("CREDIT_CARD", 0) for r in rep) >= 4  # 2 cards in prompt + response
    samples = usage.samples("tenant-0")
    assert 0 < len(samples) <= 3
    assert _leaks(repr(samples).encode()) == []
    usage.close()
