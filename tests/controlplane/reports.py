"""Constructed evaluation reports for gate and lifecycle tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def metrics(version: str, tau: float, mae: float = 0.05) -> dict:
    return {"version": version, "tau": tau, "acceptance_by_position": [0.8, 0.6, 0.4],
            "verified_per_accepted": 1.6,
            "calibration": {"mae": mae, "bins": [{"lo": 0.0, "hi": 0.5, "predicted": 0.3, "observed": 0.28,
                                                  "count": 120},
                                                 {"lo": 0.5, "hi": 1.0, "predicted": 0.7, "observed": 0.72,
                                                  "count": 180}]},
            "throughput": [{"concurrency": c, "tokens_per_s": 10.0 * c} for c in (1, 8, 32)]}


def report(candidate: str = "2", champion: str | None = "1", *, cand_tau: float = 2.2, champ_tau: float = 2.0,
           n: int = 300, mae: float = 0.05, tenants: dict | None = None, domains: dict | None = None) -> dict:
    """A report that passes the default policy unless told otherwise."""
    slices = {"acme": (150, champ_tau, cand_tau), "globex": (150, champ_tau, cand_tau)}
    return {
        "target_id": "tiny-target", "candidate_version": candidate, "champion_version": champion,
        "created_at": NOW.isoformat(), "window_start": (NOW - timedelta(hours=6)).isoformat(),
        "window_end": NOW.isoformat(), "n_records": n, "n_greedy": n, "n_sampled": 0,
        "champion": metrics(champion, champ_tau) if champion else None,
        "candidate": metrics(candidate, cand_tau, mae),
        "per_tenant": {k: {"n_records": a, "champion_tau": b, "candidate_tau": c}
                       for k, (a, b, c) in (tenants or slices).items()},
        "per_domain": {k: {"n_records": a, "champion_tau": b, "candidate_tau": c}
                       for k, (a, b, c) in (domains or {"chat": (300, champ_tau, cand_tau)}).items()},
    }


def lineage(now: datetime = NOW, *, age_days: float = 1.0, tenants=("acme", "globex"), **drop) -> dict:
    out = {"topic": "adaflash.feedback.v1", "offsets": [{"partition": 0, "start": 0, "end": 299}],
           "tenants": list(tenants), "window_start": (now - timedelta(days=age_days)).isoformat(),
           "window_end": now.isoformat(), "parent_version": "1", "source": "online"}
    for k in drop:
        out.pop(k)
    return out
