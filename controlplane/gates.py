"""Promotion gates: a versioned YAML policy and the pure function that applies it.

``evaluate_gates`` reads a shadow-evaluation report (``adaflash.contracts.evaluation``),
what the registry knows of the version, the policy and the current time, and returns one
result per gate. It touches no database and no clock, so its decisions can be tested at
the policy's edges. A value exactly at its threshold passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaflash.contracts.evaluation import EvaluationReport, SliceMetrics
from adaflash.contracts.manifest import Lineage

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent / "policy" / "default.yaml"
# Relative thresholds are compared with this slack so that a value that equals its
# threshold on paper (e.g. 1.05 / 1.0 - 1 = 0.05000000000000004) still counts as equal.
EPS = 1e-9


class GateThresholds(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_tau_gain: float
    max_tenant_regression: float = Field(ge=0.0)
    max_domain_regression: float = Field(ge=0.0)
    min_slice_records: int = Field(default=20, ge=0)
    calibration_mae_max: float = Field(ge=0.0)
    min_eval_records: int = Field(ge=0)
    require_lineage: bool = True
    training_data_ttl: bool = True
    candidate_ttl_hours: float = Field(gt=0.0)
    # Realised against predicted: the champion's live tau (what nodes serving it report)
    # over its shadow-predicted tau must be at least this, else shadow evaluation is
    # mispredicting what nodes do and its comparison is not trusted. None: gate off.
    min_champion_realised_ratio: float | None = Field(default=None, gt=0.0)


class RolloutPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    canary_fraction: float = Field(gt=0.0, le=1.0)
    watch_window_s: float = Field(ge=0.0)
    max_live_tau_regression: float = Field(ge=0.0)
    max_live_tps_regression: float = Field(ge=0.0)
    max_live_error_rate: float = Field(ge=0.0, le=1.0)
    min_watch_heartbeats: int = Field(default=3, ge=1)
    # A step whose nodes have not converged after this long rolls the promotion back.
    converge_timeout_s: float = Field(default=600.0, gt=0.0)
    # Nodes silent for controlplane.heartbeat_timeout_s: false = the rollout proceeds without
    # them (their desired version is set; they converge when they come back), true = it waits.
    wait_for_stale_nodes: bool = False
    # After completion, live metrics are still judged this long; a regression rolls back.
    post_promotion_watch_s: float = Field(default=600.0, ge=0.0)
    # Live TPS is compared only between loads this close (relative difference of requests in
    # flight): canaries against baseline nodes, or a node against its own pre-promotion load
    # profile (controlplane/canary_judge.py).
    max_load_difference: float = Field(default=0.25, ge=0.0)


class GatePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: str = Field(min_length=1)
    gates: GateThresholds
    approval: Literal["auto", "required"] = "required"
    rollout: RolloutPolicy


class PolicyError(ValueError):
    """A gate policy file that cannot be read or does not validate."""


def load_policy(path: str | Path | None = None) -> GatePolicy:
    """Read a policy file (the packaged default when ``path`` is empty)."""
    p = Path(path) if path else DEFAULT_POLICY_PATH
    try:
        data = yaml.safe_load(p.read_text())
        return GatePolicy.model_validate(data)
    except OSError as e:
        raise PolicyError(f"cannot read gate policy {p}: {e}") from e
    except (yaml.YAMLError, ValidationError) as e:
        raise PolicyError(f"invalid gate policy {p}: {e}") from e


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    value: float | None
    threshold: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VersionInfo:
    """What the control plane knows about a candidate apart from its evaluation."""

    version: str
    created_at: datetime
    lineage: Mapping[str, Any] = field(default_factory=dict)
    tenant_ttl_days: Mapping[str, float] = field(default_factory=dict)  # stored tenant policies
    default_ttl_days: float = 30.0  # for tenants without a stored policy
    champion_realised_ratio: float | None = None  # champion's realised / predicted tau (None: unknown)


def all_passed(results: list[GateResult]) -> bool:
    return bool(results) and all(r.passed for r in results)


def evaluate_gates(report: Mapping[str, Any] | EvaluationReport, version_info: VersionInfo,
                   policy: GatePolicy, now: datetime) -> list[GateResult]:
    """Every gate of ``policy`` applied to one candidate, in a fixed order."""
    g = policy.gates
    results: list[GateResult] = []
    parsed = _parse_report(report, version_info.version)
    if isinstance(parsed, str):
        results.append(GateResult("report_valid", False, None, None, parsed))
    else:
        results.append(GateResult("report_valid", True, None, None, "report matches the schema and version"))
        results += [
            _min_records(parsed, g.min_eval_records),
            _tau_gain(parsed, g.min_tau_gain),
            _worst_slice("max_tenant_regression", "tenant", parsed.per_tenant, g.max_tenant_regression,
                         g.min_slice_records),
            _worst_slice("max_domain_regression", "domain", parsed.per_domain, g.max_domain_regression,
                         g.min_slice_records),
            _calibration(parsed, g.calibration_mae_max),
        ]
    lineage = Lineage.model_validate(dict(version_info.lineage or {}))
    results.append(_lineage(lineage, g.require_lineage))
    results.append(_training_ttl(lineage, version_info, g.training_data_ttl, now))
    results.append(_candidate_ttl(version_info, g.candidate_ttl_hours, now))
    if g.min_champion_realised_ratio is not None:
        results.append(_realised(version_info.champion_realised_ratio, g.min_champion_realised_ratio))
    return results


def _realised(ratio: float | None, minimum: float) -> GateResult:
    if ratio is None:
        return GateResult("champion_realised_ratio", True, None, minimum,
                          "no realised figure for the champion yet (no champion, or no node reported)")
    ok = ratio >= minimum - EPS
    return GateResult("champion_realised_ratio", ok, ratio, minimum,
                      f"champion realised {ratio:.3f} of its predicted tau"
                      + ("" if ok else "; shadow predictions are not matching live serving"))


def _parse_report(report, version: str) -> EvaluationReport | str:
    try:
        parsed = report if isinstance(report, EvaluationReport) else EvaluationReport.model_validate(report)
    except ValidationError as e:
        err = e.errors()[0]
        return f"report does not match the schema: {'.'.join(map(str, err['loc']))}: {err['msg']}"
    if parsed.candidate_version != version:
        return f"report is for version {parsed.candidate_version!r}, not {version!r}"
    return parsed


def _min_records(r: EvaluationReport, minimum: int) -> GateResult:
    ok = r.n_records >= minimum
    return GateResult("min_eval_records", ok, float(r.n_records), float(minimum),
                      f"{r.n_records} records evaluated, {minimum} required")


def _relative_change(new: float, old: float) -> float:
    if old > 0:
        return (new - old) / old
    return 0.0 if new == old else float("inf")


def _tau_gain(r: EvaluationReport, minimum: float) -> GateResult:
    if r.champion is None:
        return GateResult("min_tau_gain", True, None, minimum, "no champion yet: nothing to gain over")
    gain = _relative_change(r.candidate.tau, r.champion.tau)
    ok = gain >= minimum - EPS
    return GateResult("min_tau_gain", ok, gain, minimum,
                      f"tau {r.candidate.tau:.4f} vs champion {r.champion.tau:.4f}: gain {gain:+.2%}, "
                      f"at least {minimum:+.2%} required")


def _worst_slice(name: str, kind: str, slices: Mapping[str, SliceMetrics], maximum: float,
                 min_records: int) -> GateResult:
    judged = {k: s for k, s in slices.items() if s.n_records >= min_records}
    if not judged:
        return GateResult(name, True, None, maximum, f"no {kind} with at least {min_records} records to judge")
    drops = {k: -_relative_change(s.candidate_tau, s.champion_tau) for k, s in judged.items()}
    worst = max(drops, key=lambda k: drops[k])
    ok = drops[worst] <= maximum + EPS
    return GateResult(name, ok, drops[worst], maximum,
                      f"worst {kind} {worst!r}: tau {judged[worst].candidate_tau:.4f} vs champion "
                      f"{judged[worst].champion_tau:.4f} ({-drops[worst]:+.2%}); at most "
                      f"{maximum:.2%} regression allowed; {len(judged)} of {len(slices)} {kind}s judged")


def _calibration(r: EvaluationReport, maximum: float) -> GateResult:
    if r.candidate.calibration is None:
        return GateResult("calibration_mae_max", False, None, maximum, "report has no length-head calibration")
    mae = r.candidate.calibration.mae
    return GateResult("calibration_mae_max", mae <= maximum + EPS, mae, maximum,
                      f"length-head calibration MAE {mae:.4f}, at most {maximum:.4f} allowed")


def lineage_gaps(lineage: Lineage) -> list[str]:
    """Fields an online candidate's lineage lacks (offline ones must name their dataset)."""
    if lineage.source != "online":
        return [] if (lineage.model_extra or {}).get("dataset") else ["dataset"]
    gaps = [f for f in ("topic", "window_start", "window_end", "parent_version") if getattr(lineage, f) is None]
    gaps += [f for f in ("offsets", "tenants") if not getattr(lineage, f)]
    return gaps


def _lineage(lineage: Lineage, required: bool) -> GateResult:
    if not required:
        return GateResult("require_lineage", True, None, None, "lineage not required by this policy")
    gaps = lineage_gaps(lineage)
    reason = "lineage complete" if not gaps else f"lineage lacks {', '.join(gaps)}"
    return GateResult("require_lineage", not gaps, None, None, f"{reason} (source {lineage.source})")


def _training_ttl(lineage: Lineage, info: VersionInfo, enabled: bool, now: datetime) -> GateResult:
    name = "training_data_ttl"
    if not enabled:
        return GateResult(name, True, None, None, "training-data TTL not checked by this policy")
    if lineage.source != "online":
        return GateResult(name, True, None, None, f"trained on {lineage.source} data, not on feedback")
    if lineage.window_start is None:
        return GateResult(name, False, None, None, "lineage has no training window start")
    tenants = lineage.tenants or []
    ttls = {t: info.tenant_ttl_days.get(t, info.default_ttl_days) for t in tenants}
    ttl = min(ttls.values(), default=info.default_ttl_days)
    strictest = min(ttls, key=lambda t: ttls[t]) if ttls else "default"
    age_days = (now - lineage.window_start).total_seconds() / 86400
    return GateResult(name, age_days <= ttl + EPS, age_days, ttl,
                      f"oldest training record is {age_days:.2f} days old; tenant {strictest!r} keeps "
                      f"feedback {ttl:g} days")


def _candidate_ttl(info: VersionInfo, ttl_hours: float, now: datetime) -> GateResult:
    age_h = (now - info.created_at).total_seconds() / 3600
    return GateResult("candidate_ttl", age_h <= ttl_hours + EPS, age_h, ttl_hours,
                      f"candidate is {age_h:.2f} h old, TTL {ttl_hours:g} h")
