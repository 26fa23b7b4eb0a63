"""Broker outage against the real broker: stop Tansu mid-stream, keep submitting, restart
it on the same port; every submitted record arrives exactly once after record_id de-dup.

Tansu's memory storage forgets topics and data on restart. The producer recreates the
topics itself after reconnecting, and sends again what the broker had acknowledged and
then forgot (it sees the topic's new id), ahead of what it spooled during the outage.
"""

import threading
import time

from adaflash.contracts.feedback import FeedbackRecord
from governance.emitter import FeedbackEmitter
from governance.pii import ScrubbedRecord
from governance.producer import FeedbackProducer
from governance.spool import Spool
from tests.governance.conftest import consume, kafka_config, make_record


class IdentityScrubber:
    """Fast stand-in: this test is about delivery, the canary test covers scrubbing."""

    def scrub_record(self, record):
        return ScrubbedRecord(record)


class Reader(threading.Thread):
    def __init__(self, bootstrap, topic):
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.seen: list[str] = []
        self.order: dict[str, list[int]] = {}
        self.stop = threading.Event()

    def run(self):
        from kafka import KafkaConsumer, TopicPartition

        while not self.stop.is_set():
            c = None
            try:
                c = KafkaConsumer(bootstrap_servers=self.bootstrap, auto_offset_reset="earliest",
                                  enable_auto_commit=False, fetch_max_wait_ms=50, request_timeout_ms=3000,
                                  reconnect_backoff_max_ms=500)
                tps = [TopicPartition(self.topic, p) for p in range(4)]
                c.assign(tps)
                c.seek_to_beginning()
                while not self.stop.is_set():
                    for msgs in c.poll(timeout_ms=100).values():
                        for m in msgs:
                            r = FeedbackRecord.from_bytes(m.value)
                            self.seen.append(r.record_id)
                            self.order.setdefault(r.tenant_id, []).append(int(r.request_id))
            except Exception:  # broker gone: reconnect from the beginning of the new topic
                time.sleep(0.3)
            finally:
                if c is not None:
                    try:
                        c.close()
                    except Exception:
                        pass


def test_outage_every_record_arrives_exactly_once(fresh_broker, tmp_path):
    b = fresh_broker
    kc = kafka_config(b.bootstrap)
    spool = Spool(tmp_path / "spool.db", 10_000)
    producer = FeedbackProducer(b.bootstrap, spool, kc, retention_ms=3_600_000, backoff_s=(0.1, 0.5))
    em = FeedbackEmitter(producer, IdentityScrubber(), workers=2, queue_size=4096)
    assert producer.flush(10)
    reader = Reader(b.bootstrap, kc.feedback_topic)
    reader.start()

    submitted: list[str] = []
    gate = threading.Event()
    gate.set()
    done = threading.Event()
    blocked = []

    def serve():
        i = 0
        while not done.is_set():
            gate.wait()
            rec = make_record(tenant=f"t{i % 3}", request_id=str(i))
            t0 = time.perf_counter()
            assert em.submit(rec)
            blocked.append(time.perf_counter() - t0)
            submitted.append(rec.record_id)
            i += 1
            time.sleep(0.005)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    time.sleep(1.5)
    # let the reader catch up on what the broker acknowledged, then pull the plug
    gate.clear()
    time.sleep(0.05)
    assert em.drain(10) and producer.flush(10)
    deadline = time.monotonic() + 15
    while len(set(reader.seen)) < len(submitted) and time.monotonic() < deadline:
        time.sleep(0.05)
    before = len(submitted)
    assert set(reader.seen) == set(submitted)
    reader.stop.set()
    reader.join(5)
    pre = list(reader.seen)
    b.stop()
    gate.set()
    deadline = time.monotonic() + 15  # serving continues with the broker down
    while time.monotonic() < deadline and producer.stats()["spool_depth"] < 50:
        time.sleep(0.1)
    assert producer.stats()["spool_depth"] >= 50
    during = len(submitted) - before
    b.start()  # same port; topics are gone until the producer recreates them
    time.sleep(1.5)
    done.set()
    server.join(5)
    assert em.drain(30)
    assert producer.flush(60), producer.stats()
    em.close()
    producer.close()
    stats = producer.stats()
    spool.close()

    assert during > 100, during
    assert max(blocked) < 0.05  # submit never waited on the broker
    # the new log: the records acknowledged before the restart, sent again, then the rest
    post = [FeedbackRecord.from_bytes(m.value) for m in consume(b.bootstrap, kc.feedback_topic,
                                                                 expect=len(submitted))]
    seen = pre + [r.record_id for r in post]
    missing = set(submitted) - set(seen)
    assert not missing, f"{len(missing)} of {len(submitted)} records lost; {stats}"
    assert len(set(seen)) == len(submitted) and set(seen) == set(submitted)  # exactly once after de-dup
    assert stats["spooled"] > 0 and stats["replayed"] > 0
    assert stats["broker_resets"] == 1 and stats["resent_after_reset"] == before, stats
    assert {r.record_id for r in post} == set(submitted)  # the new log alone has every record
    assert em.counters()["dropped"] == {}
    # per-tenant order of first arrival follows submission order
    order: dict[str, list[int]] = {}
    for r in post:
        order.setdefault(r.tenant_id, []).append(int(r.request_id))
    for tenant, seq in order.items():
        firsts = list(dict.fromkeys(seq))
        assert firsts == sorted(firsts), tenant


def test_a_broker_that_came_back_empty_gets_the_acknowledged_records_again(fresh_broker, tmp_path):
    """Records the broker acknowledged, then lost in a restart before anyone read them, are
    sent again by the producer; here the topics are re-created by someone else first (as a
    learner would), so the producer sees no outage of its own, only the topic's new id."""
    from governance.broker import ensure_topics

    b = fresh_broker
    kc = kafka_config(b.bootstrap)
    spool = Spool(tmp_path / "spool.db", 10_000)
    producer = FeedbackProducer(b.bootstrap, spool, kc, retention_ms=3_600_000, backoff_s=(0.1, 0.5))
    try:
        first = [make_record(tenant=f"t{i % 3}", request_id=str(i)) for i in range(30)]
        for rec in first:
            assert producer.send(ScrubbedRecord(rec))
        assert producer.flush(20)
        assert len(consume(b.bootstrap, kc.feedback_topic, expect=30)) == 30
        b.stop()
        b.start()  # same port, empty
        ensure_topics(b.bootstrap, kc, 3_600_000)
        deadline = time.monotonic() + 30  # noticed while idle, from the metadata
        while time.monotonic() < deadline and producer.stats()["broker_resets"] == 0:
            time.sleep(0.2)
        assert producer.stats()["broker_resets"] == 1, producer.stats()
        later = [make_record(tenant=f"t{i % 3}", request_id=str(i)) for i in range(30, 40)]
        for rec in later:
            assert producer.send(ScrubbedRecord(rec))
        assert producer.flush(30), producer.stats()
        got = [FeedbackRecord.from_bytes(m.value) for m in consume(b.bootstrap, kc.feedback_topic, expect=40)]
        assert [r.record_id for r in got if r.record_id in {x.record_id for x in first}]  # sent again
        assert sorted(r.record_id for r in got) == sorted(r.record_id for r in first + later)  # once each
        assert producer.stats()["resent_after_reset"] == 30
        for tenant in ("t0", "t1", "t2"):  # each tenant's records in the order they were sent
            ids = [int(r.request_id) for r in got if r.tenant_id == tenant]
            assert ids == sorted(ids), (tenant, ids)
    finally:
        producer.close()
        spool.close()
