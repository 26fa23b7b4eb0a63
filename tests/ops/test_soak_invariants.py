"""The soak bench's invariants fail when what they guard did not hold (synthetic runs)."""

from __future__ import annotations

import sqlite3

from bench.soak import invariants
from bench.soak_fairness import compare
from bench.soak_invariants import (
    fleet_converged,
    ledgers_match_offsets,
    no_hung_stream,
    records_accounted,
    ttft_by_tenant,
)
from bench.soak_probe import FeedbackScraper, parse_feedback


def ev(kind="chat", tenant="t0", status=200, ttft=0.5, error=None, retried=False):
    return {"t": 1.0, "kind": kind, "tenant": tenant, "node": 0, "status": status, "ttft_s": ttft,
            "latency_s": 1.0, "retried": retried, "error": error}


def ledger(path, ids):
    path.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path / "state.db")
    db.execute("CREATE TABLE trained (record_id TEXT, step INTEGER)")
    db.executemany("INSERT INTO trained VALUES (?, 1)", [(i,) for i in ids])
    db.commit()
    db.close()
    return path


def good_run(tmp_path):
    events = [ev(), ev(retried=True), ev("malformed", status=400, ttft=None, error="invalid_value: x"),
              ev("flood", "flood", 429, None, "tenant_token_budget: y"), ev("flood", "flood", 200, None)]
    faults = [{"name": "broker", "t": 5.0, "ok": True, "detail": "", "recovered_s": 3.0}]
    dirs = [ledger(tmp_path / "learner", ["a", "b"]), ledger(tmp_path / "learner-2", ["c"])]
    return events, faults, dirs


def test_all_hold_on_a_good_run(tmp_path):
    events, faults, dirs = good_run(tmp_path)
    inv = invariants(events, faults, tmp_path, 30.0, [], dirs, {"broker": "ready"})
    assert all(v["held"] for v in inv.values()), inv


def test_each_invariant_can_fail(tmp_path):
    events, faults, dirs = good_run(tmp_path)
    bad = invariants(events + [ev(status=0, error="ConnectError"), ev("malformed", status=500, ttft=None,
                                                                      error="not an OpenAI-shaped error")],
                     [{**faults[0], "recovered_s": None}], tmp_path, 0.1, [1234],
                     [dirs[0], ledger(tmp_path / "learner-3", ["a"])], {"broker": "restarting"})
    assert not any(v["held"] for v in bad.values()), bad
    assert bad["no_record_trained_twice"]["shared_between_learners"] == 1


def test_corrupted_candidate_must_be_refused_and_never_served(tmp_path):
    events, faults, dirs = good_run(tmp_path)
    ok = invariants(events, faults, tmp_path, 30.0, [], dirs, {"broker": "ready"},
                    {"7": {"state": "rejected", "served_by": []}})
    assert ok["corrupted_candidate_refused"]["held"]
    for fate in ({"state": "evaluating", "served_by": []}, {"state": "rejected", "served_by": ["node:node-1"]}):
        bad = invariants(events, faults, tmp_path, 30.0, [], dirs, {"broker": "ready"}, {"7": fate})
        assert not bad["corrupted_candidate_refused"]["held"]


# --- records, offsets, the fleet's end state, streams (bench/soak_invariants.py) ---------------------
NODES = {"emitted": 10, "dropped": {"scrub_timeout": 2, "sampled_out": 3}, "spool_pending": 1}
LEDGERS = {"consumed": 7, "by_outcome": {"trained": 6, "expired": 1}, "ids": {f"r{i}" for i in range(7)}}
# the topic as the broker kept it: r0..r6 at partition 0 offsets 0..6, r7 at 7 went to the DLQ, one unread at 8
TOPIC = {"records": {(0, i): f"r{i}" for i in range(9)}, "dlq_sources": {(0, 7)}}
KAFKA = {"lag": 1, "dlq": 1, "committed": {0: 8}}


def test_records_accounted_holds_when_every_emitted_record_is_somewhere():
    r = records_accounted(NODES, LEDGERS, KAFKA, TOPIC)
    assert r["held"] and r["unaccounted"] == 0 and r["pending"] == 2 and r["lost_by_learners"] == 0, r
    assert r["dropped_at_node"] == {"sampled_out": 3, "scrub_timeout": 2}


def test_records_accounted_fails_on_a_lost_record_an_unread_broker_or_no_feedback():
    lost = records_accounted(NODES, LEDGERS, {"lag": 0, "dlq": 1, "committed": {0: 9}}, TOPIC)
    assert not lost["held"] and lost["unaccounted"] == 1 and lost["lost_positions"] == [[0, 8]]
    # a record the learners committed past, in no ledger and not in the DLQ, is lost even when the counts add up
    gone = records_accounted({**NODES, "emitted": 9}, {**LEDGERS, "ids": LEDGERS["ids"] - {"r3"}}, KAFKA, TOPIC)
    assert not gone["held"] and gone["unaccounted"] == 0 and gone["lost_positions"] == [[0, 3]]
    assert not records_accounted(NODES, LEDGERS, None, TOPIC)["held"]
    assert not records_accounted(NODES, LEDGERS, KAFKA, None)["held"]  # the topic could not be read
    assert not records_accounted({"emitted": 0}, {"consumed": 0}, {"lag": 0, "dlq": 0}, TOPIC)["held"]


def test_scraper_sums_the_largest_counts_of_each_node_process():
    s = FeedbackScraper(None, [])
    s.observe("dataplane", 0, {"emitted": 5, "submitted": 6, "dropped": {"scrub_timeout": 1}, "spool": 0})
    s.observe("dataplane", 0, {"emitted": 2, "submitted": 2, "dropped": {}, "spool": 3})  # restarted, not yet told
    s.observe("dataplane", 1, {"emitted": 4, "submitted": 4, "dropped": {}, "spool": 1})  # the same new process
    s.observe("dataplane-2", 0, {"emitted": 3, "submitted": 3, "dropped": {"scrub_timeout": 2}, "spool": 0})
    t = s.totals()
    assert (t["emitted"], t["submitted"], t["processes"], t["spool_pending"]) == (12, 13, 3, 1)
    assert t["dropped"] == {"scrub_timeout": 3}


def test_parse_feedback_reads_the_node_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from governance.emitter import _Metrics

    m = _Metrics(CollectorRegistry())
    m.emitted.labels("t0").inc(3)
    m.emitted.labels("t1").inc(2)
    m.dropped.labels("t0", "spool_overflow").inc(4)
    m.spool_records.set(7)
    page = parse_feedback(generate_latest(m.registry).decode())
    assert (page["emitted"], page["dropped"], page["spool"]) == (5, {"spool_overflow": 4}, 7)


def test_parse_feedback_reads_tokens_and_the_served_version_and_the_timeline_rates_them(tmp_path):
    from prometheus_client import generate_latest

    from bench.soak_plot import node_rates, plot
    from dataplane.metrics import NodeMetrics

    m = NodeMetrics()
    m.tokens.inc(40)
    m.set_drafter("3")
    m.set_drafter("4")  # the previous version's series goes
    page = parse_feedback(generate_latest(m.registry).decode())
    assert (page["tokens"], page["version"]) == (40, "4")
    samples = [{"t": 0.0, "node": "a", "tokens": 0.0, "spool": 0, "version": "3"},
               {"t": 2.0, "node": "a", "tokens": 40.0, "spool": 1, "version": "4"},
               {"t": 4.0, "node": "a", "tokens": 4.0, "spool": 0, "version": "4"},  # restarted: counter back
               {"t": 6.0, "node": "a", "tokens": 10.0, "spool": 0, "version": "4"}]
    assert node_rates(samples) == {"a": [(2.0, 20.0), (6.0, 3.0)]}
    events = [{"t": 1.0, "tenant": "t0", "status": 200, "ttft_s": 0.5}, {"t": 3.0, "tenant": "t0", "status": 429,
                                                                          "ttft_s": None}]
    plot({"events": events, "timeline": samples, "faults": [{"t": 2.5, "name": "node"}],
          "invariants": {"x": {"held": True}}}, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_ledgers_match_offsets():
    stored = {"learner": {0: 5, 1: 3}, "learner-2": {1: 9}}
    assert ledgers_match_offsets({0: 5, 1: 9, 2: 0}, stored, 12, False)["held"]
    bad = ledgers_match_offsets({0: 6, 1: 9}, stored, 12, False)
    assert not bad["held"] and list(bad["mismatched"]) == [0]
    assert not ledgers_match_offsets({0: 5, 1: 9}, stored, 15, False)["held"]  # more finished than consumed
    assert ledgers_match_offsets({0: 5, 1: 9}, stored, 15, True)["held"]  # counts restart with the broker
    assert not ledgers_match_offsets(None, stored, 0, False)["held"]


def fleet(**over):
    base = {"nodes": [{"node_id": "n1", "served_version": "3", "desired_version": "3"},
                      {"node_id": "n2", "served_version": "3", "desired_version": None}],
            "audit": {"ok": True, "entries": 40}, "db_versions": {"2": "rolled_back", "3": "champion"},
            "mlflow_versions": {"2": "rolled_back", "3": "champion"},
            "db_aliases": {"champion": "3", "previous": "2"}, "mlflow_aliases": {"champion": "3", "previous": "2"}}
    return base | over


def test_fleet_converged_and_each_way_it_fails():
    assert fleet_converged(**fleet())["held"]
    for over in ({"nodes": [{"node_id": "n1", "served_version": "2", "desired_version": "3"}]},
                 {"nodes": [{"node_id": "n1", "served_version": None, "desired_version": None}]},
                 {"nodes": []}, {"audit": {"ok": False, "entries": 40, "first_bad_seq": 7}}, {"audit": None},
                 {"mlflow_versions": {"2": "champion", "3": "champion"}},
                 {"mlflow_aliases": {"champion": "2", "previous": None}}):
        assert not fleet_converged(**fleet(**over))["held"], over


def test_no_hung_stream():
    streams = [ev("stream"), ev("disconnect")]
    assert no_hung_stream(streams + [ev()], [], 60.0)["held"]
    slow = {**ev("stream"), "latency_s": 61.0}
    assert not no_hung_stream(streams + [slow], [], 60.0)["held"]
    assert not no_hung_stream(streams + [ev("stream", status=0, error="ReadTimeout")], [], 60.0)["held"]
    assert not no_hung_stream(streams, [{"t": 3.0, "kind": "stream", "tenant": "t0", "open_s": 200}], 60.0)["held"]
    assert not no_hung_stream([ev()], [], 60.0)["held"]  # no stream at all proves nothing


def test_ttft_by_tenant_and_the_fairness_ratio():
    events = [ev(tenant="t0", ttft=t) for t in (0.1, 0.2, 0.3)] + [ev(tenant="t1", ttft=1.0),
                                                                  ev("flood", "flood", 200, None)]
    by = ttft_by_tenant(events)
    assert by["t0"] == {"n": 3, "p50_s": 0.2, "p99_s": 0.3} and "flood" not in by
    flooded = {"t0": {"p99_s": 0.5}, "t1": {"p99_s": 1.5}, "flood": {"p99_s": 9.0}}
    ok = compare(by, flooded, 2.0)
    assert ok["tenants"]["t0"]["ratio"] == 1.667 and ok["tenants"]["t1"]["ratio"] == 1.5 and ok["held"]
    assert not compare(by, {**flooded, "t1": {"p99_s": 2.5}}, 2.0)["held"]
    assert not compare(by, {"t0": {"p99_s": 0.3}}, 2.0)["held"]  # a tenant with no answer under the flood


def test_without_the_flood_the_isolation_check_keeps_only_the_slo(tmp_path):
    events, faults, dirs = good_run(tmp_path)
    calm = [e for e in events if e["tenant"] != "flood"]
    inv = invariants(calm, faults, tmp_path, 30.0, [], dirs, {"broker": "ready"}, flood=False)
    assert inv["flood_is_isolated"]["held"]
    assert not invariants(calm, faults, tmp_path, 30.0, [], dirs, {"broker": "ready"})["flood_is_isolated"]["held"]
    assert not invariants(calm, faults, tmp_path, 0.1, [], dirs, {}, flood=False)["flood_is_isolated"]["held"]
