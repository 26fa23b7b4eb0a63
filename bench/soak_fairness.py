"""``adaflash bench fairness``: the other tenants' TTFT with and without the flooding tenant.

    adaflash bench fairness --minutes 2 --concurrency 4 --out out/fairness

Runs the soak twice back to back, without faults: once without the flooding tenant (the
baseline) and once with it, each with its own stack under OUT/{baseline,flood}/home.
Writes fairness.json (per tenant TTFT p50/p99 in both runs and the ratio of the p99s,
flood over baseline; ``held`` when every well-behaved tenant's ratio is within
``--max-ratio``, 2 by default) and fairness.png, and exits non-zero when it is not held.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.soak_traffic import FLOOD_TENANT


def compare(baseline: dict[str, dict], flooded: dict[str, dict], max_ratio: float = 2.0) -> dict:
    """``baseline``/``flooded``: ``ttft_by_tenant`` of the two runs."""
    tenants = sorted(t for t in baseline if t != FLOOD_TENANT)
    rows = {}
    for t in tenants:
        b, f = baseline[t].get("p99_s"), (flooded.get(t) or {}).get("p99_s")
        rows[t] = {"baseline_p99_s": b, "flood_p99_s": f,
                   "ratio": None if not b or f is None else round(f / b, 3)}
    held = bool(rows) and all(r["ratio"] is not None and r["ratio"] <= max_ratio for r in rows.values())
    return {"held": held, "max_ratio": max_ratio, "tenants": rows}


def plot(cmp: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = list(cmp["tenants"])
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(tenants))
    ax.bar([x - 0.2 for x in xs], [cmp["tenants"][t]["baseline_p99_s"] or 0 for t in tenants], 0.4,
           label="without flood")
    ax.bar([x + 0.2 for x in xs], [cmp["tenants"][t]["flood_p99_s"] or 0 for t in tenants], 0.4,
           label="with flood")
    ax.set_xticks(list(xs), [f"{t}\nx{cmp['tenants'][t]['ratio']}" for t in tenants])
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(f"tenant fairness: p99 ratio within {cmp['max_ratio']:g}x: {cmp['held']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register_bench(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("fairness", help="the other tenants' TTFT p99 with and without a flooding tenant")
    s.add_argument("--minutes", type=float, default=2.0)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--tenants", type=int, default=3)
    s.add_argument("--max-ratio", type=float, default=2.0)
    s.add_argument("--out", default="out/fairness")
    s.set_defaults(func=_cli)


def _cli(args, settings) -> int:
    from adaflash.cli import CliError
    from adaflash.config import load_config
    from bench.soak import run

    if args.minutes <= 0 or args.concurrency < 1 or args.tenants < 1 or args.max_ratio <= 0:
        raise CliError("--minutes, --concurrency, --tenants and --max-ratio must be positive")
    out = Path(args.out).resolve()
    runs = {}
    for name, flood in (("baseline", False), ("flood", True)):
        d = out / name
        result = run(load_config(args.config, home=d / "home"), args.minutes, args.concurrency, args.tenants, [],
                     d, flood=flood)
        runs[name] = result["ttft_by_tenant"]
    cmp = compare(runs["baseline"], runs["flood"], args.max_ratio) | {
        "minutes": args.minutes, "concurrency": args.concurrency, "ttft_by_tenant": runs}
    (out / "fairness.json").write_text(json.dumps(cmp, indent=2))
    plot(cmp, out / "fairness.png")
    print(json.dumps(cmp, indent=2))
    return 0 if cmp["held"] else 1
