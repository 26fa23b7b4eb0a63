"""One request's trace across node, broker and learner: the node's request span has scrub
and produce children, the Kafka record carries the produce span's traceparent, and the
learner's train step links back into that trace. Real Tansu broker, real scrubber,
in-memory span exporters per service."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from adaflash.config import KafkaConfig, LearnerConfig, load_config
from adaflash.contracts.feedback import is_evaluation_record
from adaflash.telemetry import DATAPLANE, LEARNER, SpanAttrs, Spans, reset_telemetry, setup_telemetry
from tests.stack.conftest import BLOCK

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from governance.broker import TansuBroker

    with TansuBroker(log_path=tmp_path_factory.mktemp("tansu") / "tansu.log") as b:
        yield b


def produced_record(tel, request_id: str, timeout: float = 60.0) -> str:
    """The record id the node produced for ``request_id`` (its produce span's attribute)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = tel.finished_spans()
        root = next((x for x in spans if x.name == Spans.REQUEST and x.attributes.get("request_id") == request_id), None)
        if root is not None:
            produce = next((x for x in spans if x.name == Spans.PRODUCE and x.parent is not None
                            and x.parent.span_id == root.context.span_id), None)
            if produce is not None:
                return produce.attributes[SpanAttrs.RECORD_ID]
        time.sleep(0.1)
    raise AssertionError(f"no produce span for {request_id}")


def test_request_trace_reaches_the_learner(tmp_path, broker, tiny_vocab_target, tiny_bundle):
    from dataplane.model import TargetModel
    from dataplane.node import Node
    from dataplane.server import create_app
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer
    from governance.broker import ensure_topics
    from governance.emitter import build_emitter
    from learner.service import Learner
    from tests.dataplane.conftest import LiveServer

    tag = uuid.uuid4().hex[:8]
    ident = target_identity(tiny_vocab_target)
    s = load_config(None, home=tmp_path / "home",
                    kafka=KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                                      partitions=2, consumer_group=f"learner-{tag}"),
                    learner=LearnerConfig(buffer_size=2, anchors_per_record=2, max_wait_s=180.0, publish_every=0,
                                          init_drafter=str(tiny_bundle), max_record_tokens=400,
                                          poll_timeout_ms=200))
    s.model.path, s.model.target_id, s.model.max_model_len = str(tiny_vocab_target), ident["id"], 512
    s.dataplane.block_size, s.dataplane.drafter = BLOCK, str(tiny_bundle)
    s.governance.scrubber = "inline"
    s.telemetry.exporter = "memory"
    ensure_topics(broker.bootstrap, s, 3_600_000)
    node_tel = setup_telemetry(DATAPLANE, s)
    learner_tel = setup_telemetry(LEARNER, s)
    try:
        node = Node(s, target=TargetModel.from_pretrained(tiny_vocab_target), tokenizer=Tokenizer(tiny_vocab_target),
                    target_dir=tiny_vocab_target)
        node.emitter = build_emitter(s)
        node.engine.start()
        ids = []  # requests whose record the learner trains on, one per tenant
        with LiveServer(create_app(node, "tok")) as srv:
            for tenant in ("acme", "beta"):
                # about one record in ten is reserved for shadow evaluation and never trained on
                # (is_evaluation_record): ask again until this tenant has a trainable one
                for attempt in range(8):
                    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, headers={"X-Tenant-ID": tenant},
                                   json={"messages": [{"role": "user",
                                                       "content": f"Tell {tenant} about tides ({attempt})."}],
                                         "max_tokens": 16, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    if not is_evaluation_record(produced_record(node_tel, r.json()["id"])):
                        ids.append(r.json()["id"])
                        break
            assert len(ids) == 2
        node.engine.stop()
        assert node.close_feedback(timeout=30)  # queued records to the emitter, then its drain

        learner = Learner(s)
        try:
            steps = learner.run(max_steps=1, exit_when_idle_s=60.0)  # a group join is slow on a busy machine
        finally:
            learner.close()
        assert steps == 1

        spans = node_tel.finished_spans()
        step = next(x for x in learner_tel.finished_spans() if x.name == Spans.TRAIN_STEP)
        # a full buffer trains at once; a partial one only after max_wait_s (a record that never came)
        assert step.attributes["records"] == 2, dict(step.attributes)
        linked = {(ln.context.trace_id, ln.context.span_id) for ln in step.links}
        for rid in ids:
            root = next(x for x in spans if x.name == Spans.REQUEST and x.attributes.get("request_id") == rid)
            kids = {x.name: x for x in spans if x.parent is not None and x.parent.span_id == root.context.span_id}
            assert {Spans.QUEUE, Spans.PREFILL, Spans.SPEC_ROUND, Spans.SCRUB, Spans.PRODUCE} <= set(kids)
            produce = kids[Spans.PRODUCE]
            assert produce.attributes["tenant"] == root.attributes["tenant"]
            # the learner step that trained on this request's record links to its produce span
            assert (root.context.trace_id, produce.context.span_id) in linked
    finally:
        reset_telemetry()
