"""The control plane keeps its evaluation window across a broker restart (its own copy in
the database), expires it by tenant TTL and forgets a deleted tenant."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane import eval_window
from controlplane.db import session_scope
from controlplane.models import EvalWindowRecord
from controlplane.shadow import KafkaFeedbackWindow, ShadowEvaluator
from governance.broker import TansuBroker
from tests.controlplane.shadow_util import evaluation_ids, record

# on SQLite and on PostgreSQL (a copy of the session's migrated database per test)
pytestmark = [pytest.mark.services, pytest.mark.parametrize("settings", ["sqlite", "postgresql"], indirect=True)]
TOPIC = "fb-window"


def _produce(bootstrap: str, records) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for r in records:
        producer.send(TOPIC, r.to_bytes(), key=r.tenant_id.encode())
    producer.flush()
    producer.close()


def _rows(sessions) -> dict[str, str]:
    with session_scope(sessions) as s:
        return {r.record_id: r.tenant_id for r in s.query(EvalWindowRecord)}


def test_window_survives_broker_restart(tmp_path, settings, client, admin, sessions):
    settings.kafka.feedback_topic = TOPIC
    broker = TansuBroker(log_path=tmp_path / "tansu.log").start()
    try:
        settings.kafka.bootstrap = broker.bootstrap
        r = client.put("/api/v1/tenants/brief/policy", headers=admin, json={"ttl_days": 1.0})
        assert r.status_code == 200
        ids = evaluation_ids(8)
        train_id = evaluation_ids(1, held_out=False)[0]
        recs = [record(rid, "p", f"r{i}", tenant=("acme", "beta", "brief", "gone")[i % 4])
                for i, rid in enumerate(ids[:7])]
        stale = record(ids[7], "p", "old", tenant="brief", age=timedelta(days=2))  # past brief's 1-day TTL
        _produce(broker.bootstrap, recs + [stale, record(train_id, "p", "train me")])

        source = KafkaFeedbackWindow(broker.bootstrap, TOPIC, timeout_s=10)
        evaluator = ShadowEvaluator(settings, sessions, registry=None, policy=None)  # the hook shadow.py reads
        assert isinstance(evaluator.window, eval_window.PersistentWindow)
        window = eval_window.PersistentWindow(source, sessions, settings)
        first = {r.record_id for r in window.read()}
        assert first == {r.record_id for r in recs}  # held-out, inside TTL; the training record is not kept

        broker.kill()  # kill -9 and back empty on the same port
        broker.start()
        assert list(source.read()) == []  # the broker's window is gone...
        assert {r.record_id for r in window.read()} == first  # ...the control plane's is not

        # a deletion request purges the copy, and the tenant's old records are never stored again
        r = client.post("/api/v1/deletion-requests", headers=admin,
                        json={"tenant_id": "gone", "scope": "tenant", "reason": "erase"})
        assert r.status_code == 201, r.text
        assert "gone" not in _rows(sessions).values()
        _produce(broker.bootstrap, [x for x in recs if x.tenant_id == "gone"])
        kept = {r.record_id for r in window.read()}
        assert kept == {x.record_id for x in recs if x.tenant_id != "gone"}

        # retention: brief's rows expire a day after they were created
        with session_scope(sessions) as s:
            eval_window.prune(s, now=datetime.now(UTC) + timedelta(days=1, hours=1), max_records=1000)
        assert set(_rows(sessions).values()) == {"acme", "beta"}
    finally:
        broker.stop()


def test_window_keeps_the_newest_rows(tmp_path, settings, sessions):
    now = datetime.now(UTC)
    recs = [record(rid, "p", "r", age=timedelta(minutes=10 - i)) for i, rid in enumerate(evaluation_ids(6))]
    with session_scope(sessions) as s:
        assert eval_window.store(s, recs, settings, now=now) == 6
        assert eval_window.store(s, recs, settings, now=now) == 0  # stored once
        assert eval_window.prune(s, now=now, max_records=4) == 2
    assert set(_rows(sessions)) == {r.record_id for r in recs[2:]}
