"""Plots of an evaluation, and of a version's predicted against realised live figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from adaflash.contracts.evaluation import EvaluationReport


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: EvaluationReport, directory: Path) -> dict[str, Path]:
    """tau per tenant and per domain, the reliability curve, acceptance by block position."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    champ_name = f"champion {report.champion_version}" if report.champion_version else "plain decoding"
    for name, slices in (("tau_per_tenant", report.per_tenant), ("tau_per_domain", report.per_domain)):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        keys = list(slices) or ["(none)"]
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [slices[k].champion_tau if k in slices else 0 for k in keys], 0.4,
               label=champ_name)
        ax.bar([x + 0.2 for x in xs], [slices[k].candidate_tau if k in slices else 0 for k in keys], 0.4,
               label=f"candidate {report.candidate_version}")
        ax.set_xticks(list(xs), [f"{k}\n(n={slices[k].n_records})" if k in slices else k for k in keys], fontsize=8)
        ax.set_ylabel("tau (tokens per round)")
        ax.set_title(name.replace("_", " "))
        ax.legend(fontsize=8)
        fig.tight_layout()
        out[name] = directory / f"{name}.png"
        fig.savefig(out[name], dpi=80)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect")
    for label, m in (("candidate", report.candidate), ("champion", report.champion)):
        if m is not None and m.calibration is not None and m.calibration.bins:
            b = m.calibration.bins
            ax.plot([x.predicted for x in b], [x.observed for x in b], "o-",
                    label=f"{label} {m.version} (MAE {m.calibration.mae:.3f})")
    ax.set_xlabel("predicted accepted share (a_hat)")
    ax.set_ylabel("realised accepted share")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("length-head reliability")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["reliability"] = directory / "reliability.png"
    fig.savefig(out["reliability"], dpi=80)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, m in (("candidate", report.candidate), ("champion", report.champion)):
        if m is not None and m.acceptance_by_position:
            ax.plot(range(1, len(m.acceptance_by_position) + 1), m.acceptance_by_position, "o-",
                    label=f"{label} {m.version}")
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance by block position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out["acceptance_by_position"] = directory / "acceptance_by_position.png"
    fig.savefig(out["acceptance_by_position"], dpi=80)
    plt.close(fig)
    return out


def plot_predicted_realised(rows: Sequence[dict], path: Path) -> Path:
    """Per version: shadow-predicted against realised live tau and tokens/s (C = 1).

    rows: dicts with version, predicted_tau, realised_tau, predicted_tps, realised_tps
    (None where unknown)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [str(r["version"]) for r in rows] or ["(none)"]
    xs = range(len(names))
    for ax, what, label in ((axes[0], "tau", "tau (tokens per round)"), (axes[1], "tps", "tokens/s")):
        ax.bar([x - 0.2 for x in xs], [r.get(f"predicted_{what}") or 0.0 for r in rows] or [0.0], 0.4,
               label="shadow-predicted")
        ax.bar([x + 0.2 for x in xs], [r.get(f"realised_{what}") or 0.0 for r in rows] or [0.0], 0.4,
               label="realised live")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("predicted vs realised")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

