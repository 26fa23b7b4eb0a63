"""Gate decisions at the policy's edges: exactly at a threshold passes, just past it fails."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.gates import PolicyError, VersionInfo, all_passed, evaluate_gates, load_policy
from tests.controlplane.reports import NOW, lineage, report

POLICY = load_policy()  # min_tau_gain 0.02, regressions 0.05, MAE 0.15, 200 records, 72 h, 20 per slice


def info(*, created_hours_ago: float = 1.0, lin: dict | None = None, ttls: dict | None = None) -> VersionInfo:
    return VersionInfo(version="2", created_at=NOW - timedelta(hours=created_hours_ago),
                       lineage=lineage() if lin is None else lin, tenant_ttl_days=ttls or {}, default_ttl_days=30.0)


def gate(results, name):
    (r,) = [r for r in results if r.name == name]
    return r


def test_default_policy_loads_and_a_good_candidate_passes():
    assert POLICY.policy_version == "2026.1" and POLICY.approval == "required"
    results = evaluate_gates(report(), info(), POLICY, NOW)
    assert all_passed(results), [r for r in results if not r.passed]
    assert [r.name for r in results] == ["report_valid", "min_eval_records", "min_tau_gain", "max_tenant_regression",
                                         "max_domain_regression", "calibration_mae_max", "require_lineage",
                                         "training_data_ttl", "candidate_ttl"]


@pytest.mark.parametrize("cand_tau, passed", [(2.04, True), (2.039, False), (2.041, True)])
def test_min_tau_gain_edges(cand_tau, passed):
    r = gate(evaluate_gates(report(cand_tau=cand_tau), info(), POLICY, NOW), "min_tau_gain")
    assert r.passed is passed and r.threshold == 0.02


@pytest.mark.parametrize("acme_tau, passed", [(2.09, True), (2.0889, False), (2.0911, True)])
def test_tenant_regression_edges(acme_tau, passed):
    # champion 2.2 on acme: 5 % below is 2.09.
    tenants = {"acme": (150, 2.2, acme_tau), "globex": (150, 2.0, 2.4)}
    r = gate(evaluate_gates(report(tenants=tenants), info(), POLICY, NOW), "max_tenant_regression")
    assert r.passed is passed
    assert "'acme'" in r.reason


@pytest.mark.parametrize("n, passed", [(19, True), (20, False)])
def test_small_slices_are_not_judged(n, passed):
    domains = {"chat": (280, 2.0, 2.2), "code": (n, 2.0, 1.0)}  # code halves, on few or enough records
    r = gate(evaluate_gates(report(domains=domains), info(), POLICY, NOW), "max_domain_regression")
    assert r.passed is passed


@pytest.mark.parametrize("code_tau, passed", [(1.9, True), (1.899, False), (1.901, True)])
def test_domain_regression_edges(code_tau, passed):
    domains = {"chat": (200, 2.0, 2.4), "code": (100, 2.0, code_tau)}
    r = gate(evaluate_gates(report(domains=domains), info(), POLICY, NOW), "max_domain_regression")
    assert r.passed is passed


@pytest.mark.parametrize("mae, passed", [(0.15, True), (0.1501, False), (0.1499, True)])
def test_calibration_edges(mae, passed):
    assert gate(evaluate_gates(report(mae=mae), info(), POLICY, NOW), "calibration_mae_max").passed is passed


@pytest.mark.parametrize("n, passed", [(200, True), (199, False), (201, True)])
def test_min_eval_records_edges(n, passed):
    assert gate(evaluate_gates(report(n=n), info(), POLICY, NOW), "min_eval_records").passed is passed


@pytest.mark.parametrize("hours, passed", [(72.0, True), (72.0 + 1 / 3600, False), (72.0 - 1 / 3600, True)])
def test_candidate_ttl_edges(hours, passed):
    assert gate(evaluate_gates(report(), info(created_hours_ago=hours), POLICY, NOW), "candidate_ttl").passed is passed


@pytest.mark.parametrize("days, passed", [(30.0, True), (30.0 + 1 / 86400, False), (30.0 - 1 / 86400, True)])
def test_training_data_ttl_edges(days, passed):
    r = gate(evaluate_gates(report(), info(lin=lineage(age_days=days)), POLICY, NOW), "training_data_ttl")
    assert r.passed is passed


def test_training_data_ttl_uses_the_strictest_tenant():
    r = gate(evaluate_gates(report(), info(lin=lineage(age_days=8), ttls={"globex": 7.0}), POLICY, NOW),
             "training_data_ttl")
    assert not r.passed and r.threshold == 7.0 and "'globex'" in r.reason


@pytest.mark.parametrize("lin, passed", [
    (lineage(), True),
    (lineage(offsets=None), False),
    (lineage(parent_version=None), False),
    ({"source": "offline"}, False),
    ({"source": "offline", "dataset": "sharegpt-train@2026-05"}, True),
])
def test_lineage(lin, passed):
    r = gate(evaluate_gates(report(), info(lin=lin), POLICY, NOW), "require_lineage")
    assert r.passed is passed, r.reason


def test_lineage_not_required():
    policy = POLICY.model_copy(update={"gates": POLICY.gates.model_copy(update={"require_lineage": False})})
    assert gate(evaluate_gates(report(), info(lin={}), policy, NOW), "require_lineage").passed


def test_report_for_another_version_or_off_schema_fails():
    r = evaluate_gates(report(candidate="3"), info(), POLICY, NOW)
    assert not all_passed(r) and "not '2'" in gate(r, "report_valid").reason
    broken = report()
    del broken["candidate"]["tau"]
    assert "candidate.tau" in gate(evaluate_gates(broken, info(), POLICY, NOW), "report_valid").reason
    assert not gate(evaluate_gates({}, info(), POLICY, NOW), "report_valid").passed


def test_first_candidate_has_no_champion_to_beat():
    r = evaluate_gates(report(champion=None, tenants={}, domains={}), info(), POLICY, NOW)
    assert all_passed(r) and gate(r, "min_tau_gain").value is None


def test_invalid_policy_is_refused(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("policy_version: x\ngates: {min_tau_gain: 0.1}\n")
    with pytest.raises(PolicyError, match="invalid gate policy"):
        load_policy(bad)
