"""Plots of an offline training run from its ``log.jsonl``: loss.png and tau.png."""

from __future__ import annotations

import json
from pathlib import Path


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    tr = [r for r in rows if r["type"] == "train"]
    if tr:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=0.6, label="train CE (decay-weighted)")
        va = [r for r in rows if r["type"] == "val"]
        for dom in sorted({d for r in va for d in r["val"]}):
            pts = [(r["step"], r["val"][dom]["loss"]) for r in va if dom in r["val"]]
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"val {dom}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=100)
        plt.close(fig)
    ev = [r for r in rows if r["type"] == "eval"]
    va = [r for r in rows if r["type"] == "val"]
    if ev or va:
        fig, ax = plt.subplots(figsize=(7, 4))
        for dom, color in (("chat", "tab:blue"), ("code", "tab:green"), ("math", "tab:purple")):
            pts = [(r["step"], r["tau"][dom]) for r in ev if dom in r.get("tau", {})]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=f"held-out tau {dom} (engine, k=16)")
            pts = [(r["step"], r["val"][dom]["sim_tau"]) for r in va if dom in r["val"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), ls="--", lw=0.8, color=color,
                        label=f"simulated tau {dom} (train-dist val)")
        ax.set_xlabel("step")
        ax.set_ylabel("tau (mean accepted length)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "tau.png", dpi=100)
        plt.close(fig)
