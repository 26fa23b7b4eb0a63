import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adaflash.contracts.tenancy import TenantPolicy
from governance.emitter import FeedbackEmitter
from governance.pii import ScrubbedRecord
from governance.policy import HttpPolicySource, StaticPolicySource
from governance.retention import Purgeable, is_expired, purge_tenant, topic_retention_ms
from governance.spool import Spool
from governance.usage_audit import UsageAudit
from tests.governance.conftest import make_record


def sr(tenant="acme", i=0, **kw):
    return ScrubbedRecord(make_record(tenant=tenant, request_id=str(i), **kw))


def test_spool_is_fifo_and_durable(tmp_path):
    s = Spool(tmp_path / "s.db", 100)
    recs = [sr(f"t{i % 2}", i) for i in range(10)]
    for r in recs:
        assert s.append(r, f"tp{r.record.request_id}")
    s.close()
    s = Spool(tmp_path / "s.db", 100)  # reopened: still there, same order
    assert len(s) == 10
    got = s.peek(100)
    assert [e.record_id for e in got] == [r.record_id for r in recs]
    assert got[3].traceparent == "tp3"
    assert s.ack(e.seq for e in got[:4]) == 4
    assert [e.record_id for e in s.peek(2)] == [recs[4].record_id, recs[5].record_id]
    assert s.db_mode() == "wal"
    s.close()


def test_spool_bound_drop_oldest_counts_per_tenant(tmp_path):
    drops = []
    s = Spool(tmp_path / "s.db", 5, "drop_oldest", on_drop=lambda t, r: drops.append((t, r)))
    recs = [sr(f"t{i}", i) for i in range(8)]
    for r in recs:
        assert s.append(r)
    assert len(s) == 5
    assert [e.record_id for e in s.peek(10)] == [r.record_id for r in recs[3:]]
    assert drops == [("t0", "spool_overflow"), ("t1", "spool_overflow"), ("t2", "spool_overflow")]
    assert s.counters["spool_overflow"] == 3


def test_spool_bound_refuse(tmp_path):
    drops = []
    s = Spool(tmp_path / "s.db", 3, "refuse", on_drop=lambda t, r: drops.append((t, r)))
    results = [s.append(sr("a", i)) for i in range(5)]
    assert results == [True, True, True, False, False]
    assert len(s) == 3 and drops == [("a", "spool_full")] * 2


def test_spool_takes_scrubbed_records_only(tmp_path):
    s = Spool(tmp_path / "s.db", 3)
    with pytest.raises(TypeError):
        s.append(make_record(prompt="raw text"))


def test_ttl_and_topic_retention():
    p = TenantPolicy(tenant_id="a", ttl_days=7)
    now = datetime(2026, 1, 10, tzinfo=UTC)
    assert not is_expired(make_record(created_at=now - timedelta(days=6, hours=23)), p, now)
    assert is_expired(make_record(created_at=now - timedelta(days=7)), p, now)
    pols = [TenantPolicy(tenant_id="a", ttl_days=7), TenantPolicy(tenant_id="b", ttl_days=90)]
    assert topic_retention_ms(pols, 30) == 90 * 86_400_000
    assert topic_retention_ms([], 30) == 30 * 86_400_000


def test_deletion_purges_every_local_store_and_reports_kafka(tmp_path):
    spool = Spool(tmp_path / "s.db", 100)
    usage = UsageAudit(tmp_path / "u.db")
    usage.request_samples("gone", 5)
    for i in range(6):
        spool.append(sr("gone" if i % 2 else "stay", i, prompt=f"<PERSON> canary-{i}"))
        usage.add_sample(sr("gone", i, prompt=f"<PERSON> canary-{i}"))
    gate = threading.Event()

    class Wait:
        def scrub_record(self, record):
            gate.wait(10)
            return ScrubbedRecord(record)

    class Sink:
        def send(self, r, tp=None):
            return True

    em = FeedbackEmitter(Sink(), Wait(), workers=1, scrub_timeout_s=30)
    for i in range(4):
        em.submit(make_record(tenant="gone", request_id=f"q{i}"))
    stores = [spool, usage, em]
    assert all(isinstance(s, Purgeable) for s in stores)
    now = datetime(2026, 3, 1, tzinfo=UTC)
    rep = purge_tenant("gone", stores, retention_ms=7 * 86_400_000, segment_ms=3_600_000,
                       topics=["adaflash.feedback.v1"], now=now)
    gate.set()
    em.close()
    assert rep.purged["spool"] == 3 and rep.purged["usage_audit"] == 5 and rep.purged["emitter_queue"] >= 3
    assert spool.tenants() == {"stay": 3}
    assert usage.samples("gone") == []
    assert not rep.complete_now and rep.pending[0].store == "kafka:adaflash.feedback.v1"
    assert rep.complete_by == now + timedelta(days=7, hours=1)
    json.dumps(rep.to_dict())
    spool.close()
    usage.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("s.db*"))
    for i in (1, 3, 5):
        assert f"canary-{i}".encode() not in raw  # secure_delete: bytes gone, not just unlinked


def test_usage_report_per_tenant_day(tmp_path):
    u = UsageAudit(tmp_path / "u.db")
    d1, d2 = datetime(2026, 1, 1, 12, tzinfo=UTC), datetime(2026, 1, 2, 12, tzinfo=UTC)
    u.record_emitted("a", {"PERSON": 2, "EMAIL_ADDRESS": 1}, d1)
    u.record_emitted("a", {"PERSON": 1}, d1)
    u.record_dropped("a", "queue_full", d1)
    u.record_emitted("a", {}, d2)
    u.record_dropped("b", "opt_out", d2, n=4)
    rep = u.report()
    assert rep == [
        {"tenant_id": "a", "day": "2026-01-01", "emitted": 2, "dropped": {"queue_full": 1},
         "entities": {"EMAIL_ADDRESS": 1, "PERSON": 3}},
        {"tenant_id": "a", "day": "2026-01-02", "emitted": 1, "dropped": {}, "entities": {}},
        {"tenant_id": "b", "day": "2026-01-02", "emitted": 0, "dropped": {"opt_out": 4}, "entities": {}},
    ]
    assert len(u.report("a", since=d2.date())) == 1
    assert not u.add_sample(sr("a"))  # not requested
    u.request_samples("a", 2)
    for i in range(4):
        assert u.add_sample(sr("a", i))
    assert [s["request_id"] for s in u.samples("a")] == ["2", "3"]


class _PolicyHandler(BaseHTTPRequestHandler):
    policies: dict = {}
    calls = 0

    def do_GET(self):  # noqa: N802
        type(self).calls += 1
        tenant = self.path.split("/")[4]
        p = self.policies.get(tenant)
        if p is None:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(p).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_http_policy_source_caches_keeps_last_good_and_knows_no_default():
    _PolicyHandler.policies = {"a": {"tenant_id": "a", "sampling_rate": 0.25, "opt_out": False, "ttl_days": 3,
                                     "share_cap": 0.2}}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _PolicyHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    src = HttpPolicySource(url, ttl_s=60, timeout_s=1.0, retry_s=0.0)
    try:
        assert src.get("a").sampling_rate == 0.25
        assert src.get("a").ttl_days == 3
        assert _PolicyHandler.calls == 1  # cached
        assert src.get("unknown") is None  # 404: no policy (the control plane answers every tenant)
        srv.shutdown()
        srv.server_close()
        src.invalidate("a")
        src._cache["a"] = (src._cache.get("a", (TenantPolicy(tenant_id="a", sampling_rate=0.25), 0))[0], 0)
        assert src.get("a").sampling_rate == 0.25  # unreachable: last good answer
        assert src.get("never-seen") is None  # unreachable, never answered: no policy, no default
        assert src.counters["errors"] >= 2
    finally:
        src.close()
    assert isinstance(StaticPolicySource().get("x"), TenantPolicy)
