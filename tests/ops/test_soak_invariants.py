"""The soak bench's invariants fail when what they guard did not hold (synthetic runs)."""

from __future__ import annotations

import sqlite3

from bench.soak import invariants


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
