"""Against a real broker and MLflow on SQLite: consume -> train -> checkpoint -> commit -> publish; DLQ."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adaflash.config import KafkaConfig, LearnerConfig, ModelConfig, Settings, load_config
from adaflash.contracts.topics import ensure_topics
from adaflash.telemetry import LEARNER, reset_telemetry, setup_telemetry
from dataplane.drafter_io import load_bundle
from learner.checkpoint import CheckpointStore
from learner.publish import Publisher
from learner.service import Learner, state_dir
from tests.controlplane.shadow_util import evaluation_ids
from tests.learner.tiny import TARGET_ID, committed, log_ends, make_record, produce, read_all

pytestmark = pytest.mark.services


def learner_settings(tmp_path, broker, target_dir, drafter_dir, **learner_kw) -> Settings:
    tag = uuid.uuid4().hex[:8]
    lc = dict(buffer_size=4, anchors_per_record=2, max_wait_s=1.0, init_drafter=str(drafter_dir), publish_every=0,
              max_record_tokens=160, poll_timeout_ms=200)
    lc.update(learner_kw)
    return load_config(None, home=tmp_path / "home", model=ModelConfig(path=str(target_dir), target_id=TARGET_ID),
                    kafka=KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                                      partitions=2, consumer_group=f"learner-{tag}"),
                    learner=LearnerConfig(**lc))


def test_consume_train_checkpoint_commit_publish_and_dlq(tmp_path, broker, target_dir, drafter_dir, mlflow_uri):
    s = learner_settings(tmp_path, broker, target_dir, drafter_dir, publish_every=1)
    good = [make_record(tenant=t, response=f"reply {i} from {t}.") for i, t in enumerate(["acme", "beta"] * 3)]
    bad = [("acme", b"not json"), ("acme", json.dumps({"schema_version": 1, "tenant_id": "acme"}).encode()),
           ("beta", make_record(tenant="beta", target_id="someone-else").to_bytes()),
           ("beta", make_record(tenant="beta", response="y" * 400).to_bytes())]
    old = make_record(tenant="acme", created_at=datetime.now(UTC) - timedelta(days=45))  # past the 30-day TTL
    bad.append(("acme", old.to_bytes()))
    held = make_record(tenant="beta", record_id=evaluation_ids(1)[0])  # reserved for shadow evaluation
    bad.append(("beta", held.to_bytes()))
    ensure_topics(s.kafka.bootstrap, s.kafka, 3_600_000)
    produce(broker.bootstrap, s.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in good] + bad)

    spans = InMemorySpanExporter()
    s.telemetry.exporter = "memory"
    setup_telemetry(LEARNER, s, span_exporter=spans)
    learner = Learner(s)
    learner.publisher = Publisher(mlflow_uri, learner.identity, tmp_path / "artifacts")
    steps = learner.run(exit_when_idle_s=2.0)
    assert steps >= 2

    store = CheckpointStore(state_dir(s))
    ledger = [rid for rid, _ in store.ledger()]
    assert sorted(ledger) == sorted(r.record_id for r in good)
    assert store.seen(old.record_id) and old.record_id not in ledger  # expired: never trained, not re-read
    # held out for evaluation: never trained, but finished in the ledger (accounted, not re-read)
    assert store.seen(held.record_id) and held.record_id not in ledger
    # offsets committed to the group only after the checkpoint, and up to the end of the log
    assert committed(broker.bootstrap, s.kafka.consumer_group, s.kafka.feedback_topic) == \
        log_ends(broker.bootstrap, s.kafka.feedback_topic, len(good) + len(bad)) == store.offsets(s.kafka.feedback_topic)

    dlq = read_all(broker.bootstrap, s.kafka.dlq_topic, expect=4)
    reasons = sorted(dict(m.headers)["reason"].decode() for m in dlq)
    assert reasons == ["bad_schema", "bad_schema", "too_long", "unknown_target"]
    for m in dlq:
        h = dict(m.headers)
        assert h["error"] and h["source_topic"].decode() == s.kafka.feedback_topic and "traceparent" in h

    # every step published a candidate, lineage chained through parent versions
    client = learner.publisher.client
    versions = sorted(client.search_model_versions(f"name='adaflash-drafter-{TARGET_ID}'"),
                      key=lambda v: int(v.version))
    assert len(versions) == steps
    last = versions[-1]
    assert last.tags["adaflash.state"] == "candidate"
    lineage = json.loads(last.tags["adaflash.lineage"])
    assert lineage["parent_version"] == str(versions[-2].version) and lineage["topic"] == s.kafka.feedback_topic
    first = json.loads(versions[0].tags["adaflash.lineage"])
    assert first["parent_version"] == "1"  # the bundle the learner started from
    ranges = [(r["partition"], r["start"], r["end"]) for v in versions
              for r in json.loads(v.tags["adaflash.lineage"])["offsets"]]
    assert sorted(ranges)[0][1] == 0 and max(e for _, _, e in ranges) == 5  # the six good records, offsets 0..5
    assert sorted(json.loads(versions[0].tags["adaflash.lineage"])["tenants"]) == ["acme", "beta"]
    from mlflow.artifacts import download_artifacts

    local = Path(download_artifacts(artifact_uri=last.source, dst_path=str(tmp_path / "dl"), tracking_uri=mlflow_uri))
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert hashlib.sha256((local / "manifest.json").read_bytes()).hexdigest() == last.tags["adaflash.manifest_sha256"]
    drafter, manifest = load_bundle(local, learner.target, learner.identity)
    assert manifest.lineage.model_dump(mode="json") == lineage and manifest.target.id == TARGET_ID
    for name, t in drafter.state_dict().items():
        assert torch.equal(t, learner.drafter.state_dict()[name].detach()), name  # the last step's weights
    run = client.get_run(last.run_id)
    assert run.data.params["alpha"] == "0.8" and "head_mae" in run.data.metrics and "clip_ratio" in run.data.metrics

    # traces: each step links to the traces of the records it used; each publish names its version
    finished = spans.get_finished_spans()
    steps_spans = [sp for sp in finished if sp.name == "train_step" and sp.attributes["records"]]
    assert len(steps_spans) == steps and all(sp.links for sp in steps_spans)
    assert sorted(sp.attributes["version"] for sp in finished if sp.name == "publish") == \
        sorted(str(v.version) for v in versions)
    reset_telemetry()

    # a restarted learner trains nothing twice and sends nothing new to the DLQ
    again = Learner(s)
    assert again.run(exit_when_idle_s=1.0) == 0
    store2 = CheckpointStore(state_dir(s))
    assert len(store2.ledger()) == len(good)

    # records sent again (a producer's replay) are skipped, and the offsets move past them
    produce(broker.bootstrap, s.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in good[:2]])
    third = Learner(s)
    assert third.run(exit_when_idle_s=2.0) == 0
    assert third.counters["already_trained"] == 2
    assert len(CheckpointStore(state_dir(s)).ledger()) == len(good)
    assert committed(broker.bootstrap, s.kafka.consumer_group, s.kafka.feedback_topic) == \
        log_ends(broker.bootstrap, s.kafka.feedback_topic, len(good) + len(bad) + 2)


def test_a_rebalance_that_hands_a_partition_back_loses_none_of_its_held_records(tmp_path, broker, target_dir,
                                                                                 drafter_dir):
    """The client keeps the fetch position of a partition that is revoked and assigned back
    in one rebalance, so the records the learner held for it are never fetched again: set
    aside at the revocation, they return to the buffer when the partition comes back and
    are trained; those of a partition that went elsewhere are forgotten for its next owner,
    and the offsets to commit never pass a held record."""
    from adaflash.contracts.feedback import is_evaluation_record

    s = learner_settings(tmp_path, broker, target_dir, drafter_dir, buffer_size=64, max_wait_s=3600.0)
    # keys acme and zeta go to partitions 0 and 1 of two (Kafka's murmur2 partitioner)
    recs = [make_record(tenant=t, response=f"reply {i} from {t}.") for i, t in enumerate(["acme", "zeta"] * 5)]
    trainable = sorted(r.record_id for r in recs if not is_evaluation_record(r.record_id))
    ensure_topics(s.kafka.bootstrap, s.kafka, 3_600_000)
    produce(broker.bootstrap, s.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in recs])
    learner = Learner(s)
    learner.connect()
    seen = 0
    for _ in range(200):
        for m in learner._poll():
            learner.handle(m)
            seen += 1
        if seen == len(recs):
            break
    assert seen == len(recs)
    held = sorted(i.record.record_id for i in learner.buffer.held())
    assert held == trainable
    parts = {i.partition for i in learner.buffer.held()}
    assert parts == {0, 1}, parts

    learner._revoked({0, 1})
    assert learner.buffer.held() == [] and learner.safe_offsets() == {  # held back while the rebalance runs
        p: min(i.offset for i in learner.suspended if i.partition == p) for p in (0, 1)}
    learner._assigned({0, 1})  # both came back, fetch positions kept
    assert sorted(i.record.record_id for i in learner.buffer.held()) == trainable and learner.suspended == []

    learner._revoked({0, 1})
    learner._assigned({1})  # partition 0 now belongs to another learner: its records are its to read
    assert {i.partition for i in learner.buffer.held()} == {1} and 0 not in learner.safe_offsets()
    learner._revoked({1})
    learner._assigned({0, 1})  # ... and back again (fresh state for 0: read from the committed offset)
    learner.consumer.consumer.seek(next(tp for tp in learner.consumer.consumer.assignment() if tp.partition == 0),
                                   0)  # what the client does for a partition new to this member
    learner.buffer.max_wait_s = 0.0
    learner.run(exit_when_idle_s=2.0)
    ledger = sorted(rid for rid, _ in CheckpointStore(state_dir(s)).ledger())
    assert ledger == trainable
    assert committed(broker.bootstrap, s.kafka.consumer_group, s.kafka.feedback_topic) == \
        log_ends(broker.bootstrap, s.kafka.feedback_topic, len(recs))


def test_a_learner_behind_its_traffic_sheds_stale_records_and_moves_its_offsets_past_them(
        tmp_path, broker, target_dir, drafter_dir):
    s = learner_settings(tmp_path, broker, target_dir, drafter_dir, max_record_age_s=300.0)
    now = datetime.now(UTC)
    stale = [make_record(tenant="acme", response=f"old {i}.", created_at=now - timedelta(seconds=600)) for i in range(3)]
    fresh = [make_record(tenant="beta", response=f"new {i}.") for i in range(4)]
    ensure_topics(s.kafka.bootstrap, s.kafka, 3_600_000)
    produce(broker.bootstrap, s.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in stale + fresh])
    learner = Learner(s)
    assert learner.run(exit_when_idle_s=2.0) >= 1
    assert learner.counters["stale"] == 3
    store = CheckpointStore(state_dir(s))
    ledger = [rid for rid, _ in store.ledger()]
    assert sorted(ledger) == sorted(r.record_id for r in fresh)  # only the fresh ones trained
    assert all(store.seen(r.record_id) for r in stale)  # finished untrained: never re-read
    assert committed(broker.bootstrap, s.kafka.consumer_group, s.kafka.feedback_topic) == \
        log_ends(broker.bootstrap, s.kafka.feedback_topic, len(stale) + len(fresh))
