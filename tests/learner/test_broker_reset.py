"""The learner rides out its broker: kill -9, the broker restarted empty on the same port.

A real Tansu broker (memory storage: after a restart every topic, offset and group is
gone) is killed while the learner runs, once between steps and once with records held in
its replay buffer, and restarted on the same port. Producers re-send some records they
had sent before (a node's spool replaying). The learner keeps running, re-creates its
topics, and its checkpoint ledger ends with every record exactly once. A record that is
not JSON goes to the DLQ before and after the restart: the learner's DLQ producer must
come through the restart too (an idempotent one never does, and the learner then waited
for its acknowledgements for ever).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid

import pytest

from adaflash.config import KafkaConfig, load_config
from adaflash.contracts.topics import ensure_topics
from governance.broker import TansuBroker
from tests.learner.tiny import TARGET_ID, make_record, produce

pytestmark = pytest.mark.services


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _ledger(state) -> list[str]:
    """The trained ledger, read without opening a store (a store tidies the learner's files)."""
    path = state / "state.db"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r for (r,) in db.execute("SELECT record_id FROM trained ORDER BY rowid")]
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        db.close()


def _produce_retrying(bootstrap: str, topic: str, records) -> None:
    """Producers retry until the restarted broker has the topic again."""
    deadline = time.monotonic() + 60
    while True:
        try:
            produce(bootstrap, topic, [(r.tenant_id, r.to_bytes()) for r in records])
            return
        except Exception:  # noqa: BLE001 - broker back, topic not yet re-created
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def consume_until(bootstrap: str, topic: str, want: bytes, timeout_s: float = 30.0) -> list[bytes]:
    """The topic's values from its start, read until ``want`` is among them (or the timeout)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    try:
        parts = c.partitions_for_topic(topic) or {0}
        c.assign([TopicPartition(topic, p) for p in parts])
        c.seek_to_beginning()
        out: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while want not in out and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=200).values():
                out += [m.value for m in msgs]
        return out
    finally:
        c.close()


def test_learner_survives_broker_kill_and_empty_restart(tmp_path, target_dir, drafter_dir):
    from learner.service import Learner

    tag = uuid.uuid4().hex[:8]
    broker = TansuBroker(log_path=tmp_path / "tansu.log").start()
    try:
        kafka = KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                            partitions=2, consumer_group=f"learner-{tag}")
        state = tmp_path / "state"
        settings = load_config(home=tmp_path / "home", model={"path": str(target_dir), "target_id": TARGET_ID},
                               kafka=kafka.model_dump(),
                               learner={"buffer_size": 4, "anchors_per_record": 2, "max_wait_s": 600.0,
                                        "init_drafter": str(drafter_dir), "state_dir": str(state),
                                        "publish_every": 0, "poll_timeout_ms": 200, "max_record_tokens": 160})
        ensure_topics(kafka.bootstrap, kafka, 3_600_000)
        errors: list[BaseException] = []
        made: list[Learner] = []

        def run():  # the learner's SQLite store belongs to the thread that opens it
            try:
                made.append(Learner(settings))
                made[0].run()
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        _wait(lambda: made or errors, 120, "the learner started")
        learner = made[0]
        first = [make_record(tenant=["acme", "beta"][i % 2], response=f"first answer {i}.") for i in range(8)]
        produce(broker.bootstrap, kafka.feedback_topic,
                [(r.tenant_id, r.to_bytes()) for r in first] + [("acme", b"not a record")])
        _wait(lambda: len(_ledger(state)) == 8, 120, "the first 8 records trained")
        _wait(lambda: learner.counters["dlq:bad_schema"] >= 1, 60, "the bad record in the DLQ")

        # 1. kill -9 between steps; restarted empty; a node re-sends 3 old records and 4 new ones
        broker.kill()
        time.sleep(2)
        broker.start()
        second = [make_record(tenant=["acme", "beta"][i % 2], response=f"second answer {i}.") for i in range(4)]
        _produce_retrying(broker.bootstrap, kafka.feedback_topic, first[:3] + second)
        produce(broker.bootstrap, kafka.feedback_topic, [("beta", b"not a record either")])
        _wait(lambda: len(_ledger(state)) == 12, 180, "the second batch trained after the restart")
        dlq = consume_until(broker.bootstrap, kafka.dlq_topic, b"not a record either")
        # the DLQ of the new log has the new bad record; the first one comes again only when
        # the kill took its acknowledgement with it (the DLQ is at-least-once)
        assert b"not a record either" in dlq and set(dlq) <= {b"not a record", b"not a record either"}, dlq
        assert thread.is_alive() and not errors, errors

        # 2. kill -9 while records wait in the replay buffer (2 of 4: no step yet)
        held = [make_record(tenant=["acme", "beta"][i % 2], response=f"held answer {i}.") for i in range(2)]
        produce(broker.bootstrap, kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in held])
        _wait(lambda: len(learner.buffer.held()) == 2, 60, "two records held in the buffer")
        broker.kill()
        time.sleep(2)
        broker.start()
        last = [make_record(tenant=["acme", "beta"][i % 2], response=f"last answer {i}.") for i in range(2)]
        _produce_retrying(broker.bootstrap, kafka.feedback_topic, held[:1] + last)
        _wait(lambda: len(_ledger(state)) == 16, 180, "the held records and the last ones trained")
        assert thread.is_alive() and not errors, errors
        assert learner.counters["broker_resets"] >= 2
    finally:
        for learner in made:
            learner.stop_event.set()
        thread.join(timeout=60)
        broker.stop()
    ledger = _ledger(state)
    assert len(ledger) == len(set(ledger)), "a record was trained twice"
    assert set(ledger) == {r.record_id for r in first + second + held + last}, "a record was lost"


def test_after_a_reset_a_rejoin_reads_from_the_start_not_from_stale_commits(tmp_path, target_dir, drafter_dir):
    """Offsets committed to the new broker before the reset was noticed come from positions in
    the old log. When the group's assignment arrives after the reset (the rejoin that follows
    a broker restart), a partition not yet read in the new epoch starts at offset 0."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    from learner.service import Learner

    tag = uuid.uuid4().hex[:8]
    broker = TansuBroker(log_path=tmp_path / "tansu.log").start()
    learner = None
    try:
        kafka = KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                            partitions=1, consumer_group=f"learner-{tag}")
        settings = load_config(home=tmp_path / "home", model={"path": str(target_dir), "target_id": TARGET_ID},
                               kafka=kafka.model_dump(),
                               learner={"buffer_size": 8, "max_wait_s": 600.0, "init_drafter": str(drafter_dir),
                                        "state_dir": str(tmp_path / "state"), "publish_every": 0,
                                        "poll_timeout_ms": 200, "max_record_tokens": 160})
        ensure_topics(kafka.bootstrap, kafka, 3_600_000)
        records = [make_record(response=f"answer {i}.") for i in range(5)]
        produce(broker.bootstrap, kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in records])
        stale = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=kafka.consumer_group,
                              enable_auto_commit=False)
        tp = TopicPartition(kafka.feedback_topic, 0)
        stale.assign([tp])
        stale.commit({tp: OffsetAndMetadata(3, "", -1)})  # a position from the old log
        stale.close()

        learner = Learner(settings)
        learner.connect()
        learner.epoch = 1  # the reset was noticed before the group assigned the partition
        got = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(got) < 5:
            for m in learner.consumer.poll(200):
                got.append(m.offset)
                learner.handle(m)
        assert got[:1] == [0] and sorted(set(got)) == [0, 1, 2, 3, 4], got
        assert learner.epoch_read == {0}
    finally:
        if learner is not None:
            learner.close()
        broker.stop()


def test_a_rejoin_cut_off_before_its_assignment_is_asked_for_again(tmp_path, target_dir, drafter_dir):
    """A poll that times out just after the group's join completed can cancel it before the
    assignment is applied: the partitions were revoked, the member calls itself stable, and
    no assignment ever follows. The watch asks for a rejoin, and the assignment comes."""
    from learner.resilience import STUCK_JOIN_S, BrokerWatch
    from learner.service import Learner

    tag = uuid.uuid4().hex[:8]
    broker = TansuBroker(log_path=tmp_path / "tansu.log").start()
    learner = None
    try:
        kafka = KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                            partitions=2, consumer_group=f"learner-{tag}")
        settings = load_config(home=tmp_path / "home", model={"path": str(target_dir), "target_id": TARGET_ID},
                               kafka=kafka.model_dump(),
                               learner={"buffer_size": 8, "max_wait_s": 600.0, "init_drafter": str(drafter_dir),
                                        "state_dir": str(tmp_path / "state"), "publish_every": 0,
                                        "poll_timeout_ms": 200, "max_record_tokens": 160})
        ensure_topics(kafka.bootstrap, kafka, 3_600_000)
        learner = Learner(settings)
        clock = [100.0]
        learner.watch = BrokerWatch(learner, monotonic=lambda: clock[0])
        learner.connect()
        assigned: list[set[int]] = []
        on_assigned = learner._assigned
        learner.consumer.on_assigned = lambda parts: (assigned.append(set(parts)), on_assigned(parts))

        def poll_until(pred, what):
            deadline = time.monotonic() + 60
            while not pred():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                learner.consumer.poll(200)

        poll_until(lambda: assigned, "the first assignment")
        learner._revoked({0, 1})  # the revocation of a rebalance whose join was then cut off
        for _ in range(20):  # the group stays stable: nothing but the watch asks for a rejoin
            learner.consumer.poll(200)
        assert len(assigned) == 1 and learner.suspended_parts == {0, 1}
        learner.watch.tick()
        clock[0] += STUCK_JOIN_S + 1.0
        learner.watch.tick()
        poll_until(lambda: len(assigned) == 2, "the assignment after the rejoin")
        assert assigned[-1] == {0, 1} and not learner.suspended_parts
    finally:
        if learner is not None:
            learner.close()
        broker.stop()
