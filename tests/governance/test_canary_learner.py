"""PII canaries through the rest of the path: node emitter -> scrubber -> broker -> learner buffer.

Records planted with names, emails, phones, cards, national ids, API keys and private
keys are emitted by a node's emitter (real Presidio scrubber, real Tansu broker) and
consumed by a real learner (tiny target, same code as production) that buffers, trains
one step and checkpoints. Every place the learner keeps them (its replay buffer, its
checkpoint directory, the DLQ topic) and the feedback topic are scanned: no raw canary.
"""

from __future__ import annotations

import pytest

from adaflash.config import KafkaConfig, LearnerConfig, ModelConfig, load_config
from governance.emitter import FeedbackEmitter
from governance.producer import FeedbackProducer
from governance.spool import Spool
from learner.checkpoint import CheckpointStore
from learner.service import Learner, state_dir
from tests.governance.canaries import ALL_RAW, CANARIES
from tests.governance.conftest import TRACEPARENT, consume, make_record
from tests.learner.conftest import make_drafter
from tests.learner.tiny import TARGET_ID, make_tiny_target, training_record_id

pytestmark = pytest.mark.services


def _leaks(blob: bytes) -> list[str]:
    return [raw for raw in ALL_RAW if raw.encode() in blob]


def test_canaries_never_reach_the_learner(broker, topics, scrubber, tmp_path):
    from dataplane.drafter_io import save_bundle
    from dataplane.model import TargetModel
    from dataplane.target_cache import target_identity

    target_dir = make_tiny_target(tmp_path / TARGET_ID)
    drafter_dir = tmp_path / "drafter"
    save_bundle(make_drafter(TargetModel.from_pretrained(target_dir)), drafter_dir, target_identity(target_dir),
                version="1")
    ident = {"id": TARGET_ID, "sha256": "0" * 64}
    records = [make_record(tenant=f"tenant-{i % 2}", prompt=text, response=f"Noted: {text}", request_id=f"r{i}",
                           target_model=ident, record_id=training_record_id())
               for i, (_, text, _) in enumerate(CANARIES)]

    spool = Spool(tmp_path / "spool.db", 1000)
    producer = FeedbackProducer(broker.bootstrap, spool, topics, retention_ms=3_600_000)
    emitter = FeedbackEmitter(producer, scrubber, workers=2, scrub_timeout_s=30)
    assert all(emitter.submit(r, TRACEPARENT) for r in records)
    assert emitter.drain(60) and producer.flush(30)
    emitter.close()
    producer.close()
    spool.close()

    settings = load_config(
        None, home=tmp_path / "home", model=ModelConfig(path=str(target_dir), target_id=TARGET_ID),
        kafka=KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=topics.feedback_topic,
                          dlq_topic=topics.dlq_topic, partitions=3, consumer_group="canary-learner"),
        learner=LearnerConfig(buffer_size=len(records), max_wait_s=1.0, anchors_per_record=2, publish_every=0,
                              init_drafter=str(drafter_dir), max_record_tokens=4096, poll_timeout_ms=200))
    learner = Learner(settings)
    seen_in_buffer: list[bytes] = []
    handle = learner.handle

    def spy(msg):
        outcome = handle(msg)
        seen_in_buffer.extend(it.tok.record.model_dump_json().encode() for it in learner.buffer.held())
        return outcome

    learner.handle = spy
    steps = learner.run(max_steps=1, exit_when_idle_s=20)
    assert steps == 1, dict(learner.counters)
    assert seen_in_buffer, "the learner buffered nothing"
    assert _leaks(b"".join(seen_in_buffer)) == []
    trained = {rid for rid, _ in CheckpointStore(state_dir(settings)).ledger()}
    assert trained and trained <= {r.record_id for r in records}
    files = b"".join(p.read_bytes() for p in state_dir(settings).rglob("*") if p.is_file())
    assert _leaks(files) == []
    feedback = consume(broker.bootstrap, topics.feedback_topic, expect=len(records))
    assert _leaks(b"".join(m.value for m in feedback)) == []
    dlq = consume(broker.bootstrap, topics.dlq_topic, timeout_s=5)
    assert _leaks(b"".join(m.value for m in dlq)) == []
