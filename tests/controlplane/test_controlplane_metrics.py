"""GET /metrics on the control plane: versions per state, approval wait, nodes, and the
learner group's consumer lag read from a real broker (Tansu)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from adaflash.config import load_config
from controlplane import lifecycle
from controlplane.api import create_app
from controlplane.db import session_scope, utcnow
from controlplane.states import VersionState

pytestmark = pytest.mark.services


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_without_a_broker_report_lag_unknown(tmp_path):
    settings = load_config(home=tmp_path, kafka={"bootstrap": "127.0.0.1:9"})
    app = create_app(settings)
    with session_scope(app.state.sessions) as s:
        for v in ("1", "2"):
            row = lifecycle.register_version(s, version=v, target_id="t", source_uri="file:///x", run_id=None,
                                             manifest_sha256=None, lineage={}, created_at=utcnow(),
                                             candidate_ttl_hours=72, actor="test")
        lifecycle.transition(s, row, VersionState.evaluating, actor="test")
        lifecycle.transition(s, row, VersionState.awaiting_approval, actor="test", reason="passed")
    with TestClient(app) as client:
        m = scrape(client)
    assert m[("adaflash_controlplane_versions", (("state", "registered"),))] == 1
    assert m[("adaflash_controlplane_versions", (("state", "awaiting_approval"),))] == 1
    assert m[("adaflash_controlplane_versions", (("state", "champion"),))] == 0
    assert m[("adaflash_controlplane_awaiting_approval_oldest_seconds", ())] >= 0
    assert m[("adaflash_controlplane_newest_version_age_seconds", ())] >= 0
    assert m[("adaflash_learner_lag_up", ())] == 0  # unknown, never reported as zero lag
    assert m[("adaflash_controlplane_hold", (("what", "learning"),))] == 0
    from controlplane import hold

    with session_scope(app.state.sessions) as s:
        hold.put(s, learning=True, evaluation=False, reason="measuring", actor="test")
    with TestClient(app) as client:
        m = scrape(client)
    assert m[("adaflash_controlplane_hold", (("what", "learning"),))] == 1
    assert m[("adaflash_controlplane_hold", (("what", "evaluation"),))] == 0
    assert not [k for k in m if k[0] == "adaflash_learner_lag_records"]


def test_learner_lag_from_the_broker(tmp_path, tansu):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import NewTopic
    from kafka.structs import OffsetAndMetadata

    topic, group = "adaflash.feedback.lagtest", "lag-learner"
    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=tansu)
    for i in range(10):  # one flush per record: the embedded broker under-reports batched end offsets
        producer.send(topic, key=str(i % 2).encode(), value=b"{}", partition=i % 2)
        producer.flush()
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=tansu, group_id=group, enable_auto_commit=False)
    consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(3, None, -1)})
    consumer.close()

    settings = load_config(home=tmp_path, kafka={"bootstrap": tansu, "feedback_topic": topic,
                                                 "consumer_group": group},
                           controlplane={"metrics_lag_cache_s": 0.0})
    with TestClient(create_app(settings)) as client:
        m = scrape(client)
        deadline = time.monotonic() + 30  # a scrape waits 2 s for Kafka; a busy machine may need another
        while m[("adaflash_learner_lag_up", ())] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            m = scrape(client)
    assert m[("adaflash_learner_lag_up", ())] == 1
    assert m[("adaflash_learner_lag_records", (("partition", "0"),))] == 2  # 5 written, 3 committed
    assert m[("adaflash_learner_lag_records", (("partition", "1"),))] == 5  # nothing committed yet
