"""The soak's timeline: what the fleet did, window by window, with the faults marked.

Four panels over the run's seconds: generated tokens/s per node (from the scraped
``adaflash_generated_tokens_total``) and answered requests/s; TTFT p50 and p99 per tenant
per window; answers that were not 200 (429, other 4xx, errors); each node's spool depth
and the drafter version it served. Every panel carries a dashed line per fault.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

WINDOW_S = 30.0


def _windows(events: list[dict], horizon: float) -> list[float]:
    n = max(1, int(horizon // WINDOW_S) + 1)
    return [i * WINDOW_S for i in range(n)]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def node_rates(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per node, (t, tokens/s) between consecutive scrapes; a counter that went back (a restarted
    node) starts again from its new value."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    last: dict[str, dict] = {}
    for s in sorted(samples, key=lambda s: s["t"]):
        p = last.get(s["node"])
        if p is not None and s["t"] > p["t"] and s["tokens"] >= p["tokens"]:
            out[s["node"]].append((s["t"], (s["tokens"] - p["tokens"]) / (s["t"] - p["t"])))
        last[s["node"]] = s
    return dict(out)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events, samples = result["events"], result.get("timeline", [])
    horizon = max([e["t"] for e in events] + [s["t"] for s in samples] + [1.0])
    starts = _windows(events, horizon)
    mids = [t + WINDOW_S / 2 for t in starts]
    fig, axes = plt.subplots(4, 1, figsize=(12, 12), sharex=True)

    ax = axes[0]
    for node, pts in sorted(node_rates(samples).items()):
        ax.plot([t for t, _ in pts], [r for _, r in pts], lw=0.8, label=f"{node} tokens/s")
    ok = defaultdict(int)
    for e in events:
        if e["status"] == 200:
            ok[int(e["t"] // WINDOW_S)] += 1
    ax2 = ax.twinx()
    ax2.plot(mids, [ok[i] / WINDOW_S for i in range(len(starts))], color="black", lw=1.2, label="answered req/s")
    ax.set_ylabel("generated tokens/s")
    ax2.set_ylabel("answered requests/s")
    _legend(ax, loc="upper left", fontsize=8)
    _legend(ax2, loc="upper right", fontsize=8)

    ax = axes[1]
    by_tenant: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ttft_s") is not None and e["status"] == 200:
            by_tenant[e["tenant"]][int(e["t"] // WINDOW_S)].append(e["ttft_s"])
    for i, (tenant, wins) in enumerate(sorted(by_tenant.items())):
        c = f"C{i}"
        for q, ls in ((0.5, "-"), (0.99, ":")):
            ys = [_pct(wins.get(w, []), q) for w in range(len(starts))]
            ax.plot(mids, [float("nan") if y is None else y for y in ys], ls=ls, color=c,
                    label=f"{tenant} p{int(q * 100)}")
    ax.set_ylabel(f"TTFT (s), {int(WINDOW_S)} s windows")
    _legend(ax, loc="upper left", fontsize=7, ncol=4)

    ax = axes[2]
    kinds = {"429": lambda s: s == 429, "other 4xx": lambda s: 400 <= s < 500 and s != 429,
             "error (5xx / no answer)": lambda s: s == 0 or s >= 500}
    for name, pick in kinds.items():
        counts = defaultdict(int)
        for e in events:
            if pick(e["status"]):
                counts[int(e["t"] // WINDOW_S)] += 1
        ax.plot(mids, [counts[i] for i in range(len(starts))], label=name)
    ax.set_ylabel(f"answers per {int(WINDOW_S)} s")
    _legend(ax, loc="upper left", fontsize=8)

    ax = axes[3]
    nodes = sorted({s["node"] for s in samples})
    versions = sorted({s["version"] for s in samples if s["version"] is not None}, key=lambda v: (len(v), v))
    ax2 = ax.twinx()
    for i, node in enumerate(nodes):
        pts = [s for s in samples if s["node"] == node]
        ax.plot([s["t"] for s in pts], [s["spool"] for s in pts], color=f"C{i}", lw=0.8, label=f"{node} spool")
        vs = [(s["t"], versions.index(s["version"])) for s in pts if s["version"] is not None]
        ax2.step([t for t, _ in vs], [v for _, v in vs], where="post", color=f"C{i}", ls="--", lw=1.2,
                 label=f"{node} drafter")
    ax2.set_yticks(range(len(versions)), [f"v{v}" for v in versions])
    if not samples:
        ax.text(0.5, 0.5, "no /metrics samples in this result", ha="center", transform=ax.transAxes)
    ax.set_ylabel("spool depth (records)")
    ax2.set_ylabel("served drafter version")
    _legend(ax, loc="upper left", fontsize=8)
    _legend(ax2, loc="upper right", fontsize=8)
    ax.set_xlabel("seconds since the soak began")

    for ax in axes:
        for f in result["faults"]:
            ax.axvline(f["t"], color="grey", ls="--", lw=0.8)
    for f in result["faults"]:
        axes[0].text(f["t"], 1.0, f["name"], rotation=90, fontsize=8, va="bottom",
                     transform=axes[0].get_xaxis_transform())
    held = sum(v["held"] for v in result["invariants"].values())
    fig.suptitle(f"soak: {len(events)} requests, {len(result['faults'])} faults, "
                 f"{held}/{len(result['invariants'])} invariants held")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
