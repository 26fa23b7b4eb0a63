from adaflash.config import load_config
from adaflash.contracts.feedback import FeedbackRecord
from governance.emitter import build_emitter
from governance.pii import ScrubbedRecord
from tests.governance.conftest import TRACEPARENT, consume, make_record


class Identity:
    def scrub_record(self, record):
        return ScrubbedRecord(record)


def test_build_emitter_wires_spool_producer_usage(broker, tmp_path):
    settings = load_config(home=tmp_path)
    settings.kafka.request_timeout_ms = 2000
    settings.kafka.feedback_topic = "built.feedback.v1"
    em = build_emitter(settings, bootstrap=broker.bootstrap, scrubber=Identity())
    recs = [make_record(tenant="b1", request_id=str(i)) for i in range(5)]
    for r in recs:
        assert em.submit(r, TRACEPARENT)
    assert em.drain(10) and em.sink.flush(20)
    # the node's /metrics shows the spool's length (records waiting for the broker)
    assert em.metrics.registry.get_sample_value("adaflash_feedback_spool_records") == 0.0
    em.close()
    msgs = consume(broker.bootstrap, "built.feedback.v1", expect=5)
    assert {FeedbackRecord.from_bytes(m.value).record_id for m in msgs} == {r.record_id for r in recs}
    assert (tmp_path / "governance" / "spool.db").exists()
    from governance.usage_audit import UsageAudit

    assert UsageAudit(tmp_path / "governance" / "usage.db").report("b1")[0]["emitted"] == 5
