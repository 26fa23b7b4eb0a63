"""A deletion request, end to end: control plane over HTTP, a node's reconciler, a learner.

Real broker (Tansu), real control plane (uvicorn on a random port), a node's real
emitter / producer / spool / usage audit (its broker unreachable, so records wait in
the spool), a real learner on a tiny target that trained on both tenants and holds
more of them in its buffer, a stored evaluation report and a JSONL evaluation window.
After the deletion of one tenant, every file those stores own is scanned for its
record ids and texts: none are left; the other tenant's are all there.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from adaflash.config import KafkaConfig, LearnerConfig, ModelConfig, load_config
from adaflash.contracts.feedback import is_evaluation_record
from tests.governance.conftest import free_dead_port
from tests.learner.tiny import TARGET_ID, make_record, make_tiny_target, produce

pytestmark = pytest.mark.services

GONE, STAY = "gone-co", "stay-co"


class PassThrough:
    """Scrubbing is not under test here: records are already clean."""

    def scrub_record(self, record):
        from governance.pii import ScrubbedRecord

        return ScrubbedRecord(record)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eval_id() -> str:
    while True:
        rid = uuid.uuid4().hex
        if is_evaluation_record(rid):
            return rid


def _rec(tenant: str, tag: str, **kw):
    """A record whose texts carry a unique marker we can look for in files."""
    return make_record(tenant=tenant, prompt=f"Question {tag} from {tenant}?",
                       response=f"Answer marker-{tag}-{tenant}.", **kw)


def _needles(records, texts: bool = True) -> list[str]:
    """A record's id and the marker its response text carries."""
    out = []
    for r in records:
        out.append(r.record_id)
        if texts:
            out.append(r.response_text.removeprefix("Answer ").rstrip("."))
    return out


def _files(*roots: Path) -> list[Path]:
    return [p for r in roots for p in ([r] if r.is_file() else r.rglob("*")) if p.is_file()]


def _scan(files: list[Path], needles: list[str]) -> set[str]:
    blobs = [p.read_bytes() for p in files]
    return {n for n in needles if any(n.encode() in b for b in blobs)}


@pytest.fixture
def controlplane(tmp_path):
    import uvicorn

    from controlplane.api import create_app

    window = tmp_path / "cp" / "window.jsonl"
    settings = load_config(home=tmp_path / "cp", controlplane={
        "feedback_source": "jsonl", "feedback_jsonl": str(window), "deletion_learners": ["learner-0"]},
        kafka={"feedback_topic": "fb-del", "dlq_topic": "dlq-del", "segment_ms": 3_600_000})
    app = create_app(settings)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    admin = {"Authorization": "Bearer " + (settings.home / "admin-token").read_text().strip()}
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", settings=settings, app=app, admin=admin, window=window)
    server.should_exit = True
    t.join(10)


def _key(cp, role: str, **kw) -> str:
    r = httpx.post(f"{cp.url}/api/v1/keys", headers=cp.admin, json={"name": f"t-{role}", "role": role, **kw})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _seed_evaluation(cp, records):
    """A stored report with a slice per tenant (plots drawn), and candidates with lineage."""
    from adaflash.contracts.evaluation import DrafterMetrics, EvaluationReport, SliceMetrics
    from controlplane.db import session_scope
    from controlplane.models import Evaluation, Version
    from controlplane.shadow import write_plots
    from controlplane.shadow.store import evaluations_dir

    now = datetime.now(UTC)
    report = EvaluationReport(
        target_id=TARGET_ID, candidate_version="7", champion_version=None, window_start=now - timedelta(hours=1),
        window_end=now, n_records=len(records), n_greedy=len(records), n_sampled=0, champion=None,
        candidate=DrafterMetrics(version="7", tau=1.5, verified_per_accepted=1.2),
        per_tenant={t: SliceMetrics(n_records=2, champion_tau=1.0, candidate_tau=1.5) for t in (GONE, STAY)})
    with session_scope(cp.app.state.sessions) as s:
        for v, tenants, parent in (("7", [GONE, STAY], "1"), ("8", [STAY], "7"), ("9", [STAY], "1")):
            s.add(Version(version=v, target_id=TARGET_ID, source_uri=f"file:///nowhere/{v}", manifest_sha256="0" * 64,
                          state="awaiting_approval", lineage={"tenants": tenants, "parent_version": parent}))
        s.flush()
        ev = Evaluation(version="7", status="completed", report=report.model_dump(mode="json"), plots={})
        s.add(ev)
        s.flush()
        d = evaluations_dir(cp.settings) / str(ev.id)
        d.mkdir(parents=True)
        (d / "report.json").write_text(report.model_dump_json())
        ev.plots = {n: str(p.relative_to(d.parent)) for n, p in write_plots(report, d).items()}
        eid = ev.id
    cp.window.write_text("".join(r.model_dump_json() + "\n" for r in records))
    return eid


def _learner(tmp_path, broker, cp, token_file: Path):
    from dataplane.drafter import new_drafter
    from dataplane.drafter_io import save_bundle
    from dataplane.model import TargetModel
    from dataplane.target_cache import target_identity

    tdir = make_tiny_target(tmp_path / "target" / TARGET_ID)
    bundle = tmp_path / "drafter"
    save_bundle(new_drafter(TargetModel.from_pretrained(tdir), seed=0, num_layers=1, n_target_layers=2, block_size=8,
                            head_hidden=16), bundle, target_identity(tdir), version="1", lineage={"source": "random"})
    tag = uuid.uuid4().hex[:8]
    return load_config(None, home=tmp_path / "learner-home", model=ModelConfig(path=str(tdir), target_id=TARGET_ID),
                       kafka=KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}",
                                         dlq_topic=f"dlq-{tag}", partitions=2, consumer_group=f"learner-{tag}"),
                       learner=LearnerConfig(buffer_size=4, anchors_per_record=2, max_wait_s=0.5, epochs=1,
                                             init_drafter=str(bundle), publish_every=0, max_record_tokens=160,
                                             poll_timeout_ms=200, controlplane_url=cp.url,
                                             controlplane_token_file=str(token_file), learner_id="learner-0",
                                             deletion_poll_s=0.0))


def _learner_holding_both(tmp_path, broker, cp):
    """A learner that trained on both tenants and holds more of both in its buffer."""
    from adaflash.contracts.topics import ensure_topics
    from learner.service import Learner

    ls = _learner(tmp_path, broker, cp, tmp_path / "learner.token")
    trained = [_rec(t, f"t{i}") for i in range(2) for t in (GONE, STAY)]
    ensure_topics(ls.kafka.bootstrap, ls.kafka, 3_600_000)
    produce(broker.bootstrap, ls.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in trained])
    first = Learner(ls)
    assert first.run(exit_when_idle_s=1.5) >= 1
    held = [_rec(t, f"h{i}") for i in range(1) for t in (GONE, STAY)]
    produce(broker.bootstrap, ls.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in held])
    learner = Learner(ls)
    learner.connect()
    deadline = time.monotonic() + 30
    while len(learner.buffer.held()) < len(held) and time.monotonic() < deadline:
        for m in learner.consumer.poll(200):
            learner.handle(m)
    assert sorted(i.record.record_id for i in learner.buffer.held()) == sorted(r.record_id for r in held)
    assert sorted(r for r, _ in learner.store.ledger()) == sorted(r.record_id for r in trained)
    return ls, first, learner, trained, held


def _node_spooling_both(tmp_path, cp, node_key):
    """A node whose broker is unreachable: both tenants' records wait in its spool; samples kept."""
    from dataplane.reconcile import Reconciler
    from governance.emitter import build_emitter
    from governance.policy import StaticPolicySource

    ns = load_config(home=tmp_path / "node-home", governance={"scrubber": "inline"},
                     kafka={"request_timeout_ms": 1000, "delivery_timeout_ms": 2000, "max_block_ms": 500})
    emitter = build_emitter(ns, bootstrap=f"127.0.0.1:{free_dead_port()}", policy=StaticPolicySource(),
                            scrubber=PassThrough(), retention_ms=7 * 86_400_000)
    for t in (GONE, STAY):
        emitter.usage.request_samples(t, 5)
    spooled = [_rec(t, f"s{i}") for i in range(2) for t in (GONE, STAY)]
    for r in spooled:
        assert emitter.submit(r)
    spool = emitter.sink.spool
    deadline = time.monotonic() + 30
    while len(spool) < len(spooled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spool.tenants() == {GONE: 2, STAY: 2}
    node = SimpleNamespace(node_id="node-1", emitter=emitter, last_load_error=None,
                           engine=SimpleNamespace(drafter_version=None),
                           live_status=lambda: {"version": None, "tau": 1.0, "tps": 0.0, "error_rate": 0.0})
    rec = Reconciler(node, cp.url, node_key, "http://127.0.0.1:1")
    rec.tick()  # heartbeat: the control plane now knows node-1
    assert rec.last_error is None
    return ns, emitter, spool, spooled, rec


def _assert_scoped_to_the_node(cp, req, node_key) -> None:
    """A node sees only its own work; it cannot act for another instance or a learner."""
    work = httpx.get(f"{cp.url}/api/v1/deletion-requests", params={"instance": "node-1"},
                     headers={"Authorization": f"Bearer {node_key}"})
    assert [w["id"] for w in work.json()] == [req["id"]]
    other = httpx.get(f"{cp.url}/api/v1/deletion-requests", params={"instance": "node-2"},
                      headers={"Authorization": f"Bearer {node_key}"})
    assert other.status_code == 403
    bad = httpx.post(f"{cp.url}/api/v1/deletion-requests/{req['id']}/ack", json={"component": "learner",
                     "instance": "learner-0"}, headers={"Authorization": f"Bearer {node_key}"})
    assert bad.status_code == 403


def _assert_every_component_purged(done: dict) -> None:
    """What each component purged, what Kafka still holds and until when, the candidates trained on it."""
    by = {(c["component"], c["instance"]): c for c in done["components"]}
    assert by[("node", "node-1")]["purged"] == {"emitter_queue": 0, "producer_queue": 0, "spool": 2,
                                                "usage_audit": 2}
    assert by[("learner", "learner-0")]["purged"] == {"replay_buffer": 1, "deferred": 0, "unfinished": 0,
                                                      "ledger_ids": 2, "dedup_ids": 2}
    assert by[("learner", "learner-0")]["detail"]["weights_trained_on_tenant"] is True
    last_ack = max(datetime.fromisoformat(c["acked_at"]) for c in done["components"])
    topics = {p["store"]: datetime.fromisoformat(p["gone_by"]) for p in done["pending"]}
    assert set(topics) == {"kafka:fb-del", "kafka:dlq-del"}
    assert topics["kafka:fb-del"] == last_ack + timedelta(days=30, hours=1)  # default TTL + segment roll
    assert datetime.fromisoformat(done["complete_by"]) == topics["kafka:fb-del"]
    assert [(c["version"], c["trained_on"]) for c in done["trained_in_candidates"]] == \
        [("7", "directly"), ("8", "parent 7")]
    assert done["result"]["trained_in_candidates"] == done["trained_in_candidates"]


def _assert_audited(cp, req) -> None:
    """The audit chain verifies and records every step of the request."""
    v = httpx.get(f"{cp.url}/api/v1/audit/verify", headers=cp.admin).json()
    assert v["ok"] is True
    entries = httpx.get(f"{cp.url}/api/v1/audit", params={"tenant_id": GONE, "limit": 100}, headers=cp.admin).json()
    actions = [e["action"] for e in entries if e["target"] == f"deletion:{req['id']}"]
    assert actions[0] == "deletion.request" and actions[1] == "deletion.purge" and actions[-1] == "deletion.complete"
    assert actions.count("deletion.ack") == 2
    complete = entries[-1]["after"]
    assert {p["store"] for p in complete["pending"]} == {"kafka:fb-del", "kafka:dlq-del"}


def test_deletion_request_purges_every_store(tmp_path, broker, controlplane):
    from controlplane.db import session_scope

    torch.set_num_threads(1)
    cp = controlplane
    node_key, learner_key = _key(cp, "node", node_id="node-1"), _key(cp, "learner", node_id="learner-0")
    (tmp_path / "learner.token").write_text(learner_key)

    # --- the learner trains on both tenants, then holds more of both in its buffer -------------
    ls, first, learner, trained, held = _learner_holding_both(tmp_path, broker, cp)

    # --- a node: broker unreachable, so its records wait in the spool; samples kept -----------
    ns, emitter, spool, spooled, rec = _node_spooling_both(tmp_path, cp, node_key)

    # --- the control plane: a report with both tenants' slices, a JSONL window ----------------
    window = [_rec(t, f"w{i}", record_id=_eval_id()) for i in range(2) for t in (GONE, STAY)]
    eid = _seed_evaluation(cp, window)

    everything = trained + held + spooled + window
    gone = [r for r in everything if r.tenant_id == GONE]
    learner_dir = Path(ls.learner.state_dir or ls.home / "learner")
    # The scan sees them before the request: the deleted tenant's ids (ledger), records
    # (spool, samples, window).
    on_disk = set(_needles([r for r in trained if r.tenant_id == GONE], texts=False)
                  + _needles([r for r in spooled + window if r.tenant_id == GONE]))
    assert _scan(_files(ns.home, learner_dir, cp.settings.home), sorted(on_disk)) == on_disk

    # --- the request ------------------------------------------------------------------------------
    r = httpx.post(f"{cp.url}/api/v1/deletion-requests", headers=cp.admin, json={"tenant_id": GONE})
    assert r.status_code == 201, r.text
    req = r.json()
    assert req["state"] == "running" and req["scope"] == "tenant" and req["provisional"]
    assert sorted(req["waiting_for"]) == ["learner:learner-0", "node:node-1"]
    cp_ack = next(c for c in req["components"] if c["component"] == "controlplane")
    assert cp_ack["state"] == "acked" and cp_ack["purged"] == {"evaluation_reports": 1, "evaluation_window": 2,
                                                           "evaluation_window_copy": 0}
    _assert_scoped_to_the_node(cp, req, node_key)

    rec.tick()  # the node purges and acknowledges
    assert rec.deletions() == []  # nothing left for it
    learner.deletions.tick()  # the learner purges and acknowledges

    r = httpx.get(f"{cp.url}/api/v1/deletion-requests/{req['id']}", headers=cp.admin)
    done = r.json()
    assert done["state"] == "completed" and done["waiting_for"] == [] and not done["provisional"]
    _assert_every_component_purged(done)
    listed = httpx.get(f"{cp.url}/api/v1/deletion-requests", params={"state": "completed"}, headers=cp.admin)
    assert [x["id"] for x in listed.json()] == [req["id"]]

    # --- afterwards: nothing of the tenant is used or stored again ------------------------------
    # de-duplication still holds for a purged id; a re-delivered old record is refused
    assert all(learner.store.seen(r.record_id) for r in trained if r.tenant_id == GONE)
    again = SimpleNamespace(partition=0, offset=10_000, value=held[0].to_bytes(), headers=[])
    assert learner.handle(again) == "deleted"
    # the node drops a late record of the tenant created before the request (still on its way)
    late = _rec(GONE, "late", created_at=datetime.fromisoformat(req["created_at"]) - timedelta(seconds=1))
    assert emitter.submit(late) and emitter.drain(10)
    assert spool.tenants() == {STAY: 2}
    assert emitter.counters()["dropped"][GONE]["deleted"] == 1
    gone.append(late)
    # shadow evaluation refuses the tenant's records Kafka still holds
    from controlplane import deletion as cpdel
    from controlplane.shadow import RecordsWindow, select_window

    with session_scope(cp.app.state.sessions) as s:
        cut = cpdel.deleted_before(s)
    picked = select_window(RecordsWindow(window).read(), now=datetime.now(UTC), target_id=None, tenant_ttl_days={},
                           default_ttl_days=30, deleted_before=cut)
    assert {r.tenant_id for r in picked} == {STAY}

    # --- audit: the chain verifies and records every step ----------------------------------------
    _assert_audited(cp, req)

    # --- scan every file of every store ---------------------------------------------------------
    learner.close()
    first.close()
    emitter.close(timeout=2)
    cp.app.state.engine.dispose()
    files = _files(ns.home, learner_dir, cp.settings.home)
    assert any(p.name.endswith("-wal") for p in files) or any(p.name == "controlplane.db" for p in files)
    assert _scan(files, _needles(gone)) == set(), "the deleted tenant's records are still stored"
    # The other tenant's: ids in the ledger (the learner keeps no text), records in the
    # spool, the samples and the window (what it holds in memory only is not on disk).
    expect = set(_needles([r for r in trained if r.tenant_id == STAY], texts=False)
                 + _needles([r for r in spooled + window if r.tenant_id == STAY]))
    kept = _scan(files, sorted(expect))
    assert kept == expect, f"the other tenant lost data: {expect - kept}"
    import json

    report = json.loads((cp.settings.home / "evaluations" / str(eid) / "report.json").read_text())
    assert list(report["per_tenant"]) == [STAY]


def test_node_purge_catches_records_on_their_way(tmp_path):
    """Queued records are purged; one a worker is scrubbing during the purge is dropped
    after it; the spool refuses the tenant's older records from then on."""
    from governance.emitter import FeedbackEmitter
    from governance.pii import ScrubbedRecord
    from governance.spool import Spool

    gate = threading.Event()

    class Slow:
        def scrub_record(self, record):
            gate.wait(10)
            return ScrubbedRecord(record)

    spool = Spool(tmp_path / "s.db", 100)

    class Sink:
        name = "producer_queue"

        def __init__(self):
            self.spool, self.sent = spool, []

        def send(self, r, tp=None):
            self.sent.append(r.tenant_id)
            return spool.append(r, tp)

        def purge_tenant(self, tenant_id):
            return 0

    sink = Sink()
    em = FeedbackEmitter(sink, Slow(), workers=1, scrub_timeout_s=30)
    records = [_rec(GONE, "a"), _rec(GONE, "b"), _rec(STAY, "c"), _rec(GONE, "d")]
    cutoff = datetime.now(UTC)  # the request: after these records were made
    for r in records:
        em.submit(r)
    time.sleep(0.2)  # the worker holds the first one in its scrub
    out = {}
    t = threading.Thread(target=lambda: out.update(rep=em.purge_stores(GONE, cutoff, wait_s=10)))
    t.start()
    time.sleep(0.2)
    gate.set()
    t.join(15)
    assert em.drain(10)
    rep = out["rep"]
    assert rep.purged == {"emitter_queue": 2, "producer_queue": 0, "spool": 0} and not rep.failed
    assert sink.sent == [STAY]
    assert em.counters()["dropped"][GONE] == {"deleted": 3}
    assert not spool.append(ScrubbedRecord(_rec(GONE, "late", created_at=cutoff - timedelta(seconds=1))))
    assert spool.append(ScrubbedRecord(_rec(GONE, "new", created_at=cutoff + timedelta(seconds=1))))
    em.close()
    spool.close()
