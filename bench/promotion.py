"""Promotion latency and the serving pause at swap, on the embedded pieces.

    python -m bench.promotion [--target tiny|real] [--out DIR]
    adaflash bench promotion ...

Builds the embedded control plane (MLflow on SQLite with local artifacts, the
control-plane database, the admin API over HTTP, its workers running as in
`adaflash controlplane`) and two serving nodes over HTTP (one canary) that heartbeat
it; a client keeps sending completions. Then, with the gate policy approving
automatically and a short watch window (both policy settings, printed in the result):

- latency: a candidate registered in MLflow -> champion on every node, with the time
  of each milestone (discovered, evaluated, gated, canary, canary serving, watching,
  rolling out, champion, each node serving it as its GET /admin/drafter says);
- pause: the serving pause of a hot swap as each node reports it (pause_ms of POST
  /admin/drafter), over the rollout's pushes and over repeated swaps under traffic.

Writes result.json and timeline.png to --out and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

GOAL_LATENCY_S = 60.0
GOAL_PAUSE_MS = 50.0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(target: str = "tiny", out: Path = Path("out/bench-promotion"), swaps: int = 20,
        watch_s: float = 3.0, records: int = 24) -> dict:
    import torch
    from sqlalchemy import select

    from adaflash.config import load_config
    from bench.embedded_stack import (
        NODE_ADMIN_TOKEN,
        Traffic,
        build_stack,
        feedback_records,
        tiny_target_dir,
    )
    from controlplane.models import Version
    from dataplane.target_cache import ensure_target
    from dataplane.tokenizer import Tokenizer

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="adaflash-bench-promotion-"))
    real_dir = ensure_target(load_config(), progress=False)
    target_dir = real_dir if target == "real" else tiny_target_dir(root / "target", real_dir)
    tok = Tokenizer(target_dir)
    from dataplane.target_cache import target_identity

    recs = feedback_records(tok, n=records, target_id=target_identity(target_dir)["id"])
    st = build_stack(root, target_dir, recs, policy_overrides={"watch_window_s": watch_s, "min_watch_heartbeats": 2},
                     approval="auto", max_model_len=512 if target == "tiny" else 1024)
    st.settings.controlplane.worker_interval_s = 0.5
    st.settings.controlplane.shadow_interval_s = 2.0
    st.reconcile_interval_s = 1.0
    sessions = st.workers.sessions
    try:
        starter = st.bundle("starter", seed=0, version="starter")
        st.start_node("node-a", starter)
        st.start_node("node-b", starter)
        st.admin.set_node_role("node-a", "canary")
        st.workers.start()
        with Traffic(st) as traffic:
            # First drafter, to have a champion to replace.
            v1 = st.publish(seed=1)
            _wait(lambda: _served(st) == {"node-a": v1, "node-b": v1}, 180, "first champion everywhere")
            time.sleep(watch_s)
            n_push_before = len(st.workers.reconciler.pushes)
            # The measured promotion.
            marks: dict[str, float] = {}
            t0 = time.monotonic()
            v2 = st.publish(seed=2)
            marks["registered_in_mlflow"] = time.monotonic() - t0
            stop = threading.Event()

            watcher = threading.Thread(target=_watch, args=(sessions, v2, t0, marks, stop), daemon=True)
            watcher.start()
            _wait(lambda: _served(st) == {"node-a": v2, "node-b": v2} and _state(sessions, v2) == "champion", 300,
                  "candidate champion everywhere")
            latency = time.monotonic() - t0
            stop.set()
            watcher.join()
            marks["champion_on_every_node"] = latency
            rollout_pauses = [r.pause_ms for r in st.workers.reconciler.pushes[n_push_before:]
                              if r.ok and r.pause_ms is not None]
            # Repeated hot swaps under traffic, straight to the nodes' admin endpoint.
            st.workers.stop(timeout_s=10)
            pauses, answer_s = _hot_swaps(st, (v1, v2), swaps, NODE_ADMIN_TOKEN)
            served_ok, failures = traffic.ok, list(traffic.failures)
        with sessions() as s:
            report = s.scalars(select(Version).where(Version.version == v2)).one()
        result = {
            "target": target, "target_id": st.identity["id"], "nodes": 2, "canary_nodes": ["node-a"],
            "policy": {"approval": "auto", "watch_window_s": watch_s, "min_watch_heartbeats": 2,
                       "node_heartbeat_interval_s": st.reconcile_interval_s,
                       "controlplane_worker_interval_s": st.settings.controlplane.worker_interval_s},
            "evaluation_records": records,
            "promotion_latency_s": round(latency, 3),
            "milestones_s": {k: round(v, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
            "swap_pause_ms": {"rollout_pushes": [round(x, 3) for x in rollout_pauses],
                              "n": len(pauses), "p50": _round(_pct(pauses, 0.5)), "p99": _round(_pct(pauses, 0.99)),
                              "max": _round(max(pauses) if pauses else None),
                              "mean": _round(statistics.fmean(pauses) if pauses else None)},
            "load_request_s": {"p50": _round(_pct(answer_s, 0.5)), "max": _round(max(answer_s) if answer_s else None)},
            "requests_served": served_ok, "request_failures": failures[:10],
            "final_state": report.state,
            "goals": {"latency_s": GOAL_LATENCY_S, "pause_ms": GOAL_PAUSE_MS,
                      "latency_met": latency < GOAL_LATENCY_S,
                      "pause_met": bool(pauses) and max(pauses) < GOAL_PAUSE_MS},
        }
    finally:
        st.close()
    (out / "result.json").write_text(json.dumps(result, indent=2))
    _plot(result, out / "timeline.png")
    return result


def _watch(sessions, version: str, t0: float, marks: dict[str, float], stop: threading.Event) -> None:
    """Record when ``version`` reaches each state and each node serves it (seconds after ``t0``)."""
    from sqlalchemy import select

    from controlplane.models import Node, Promotion, Version

    while not stop.is_set():
        now = time.monotonic() - t0
        with sessions() as s:
            v = s.get(Version, version)
            p = s.scalars(select(Promotion).where(Promotion.version == version)).first()
            nodes = {n.node_id: n.served_version for n in s.scalars(select(Node))}
        if v is not None:
            marks.setdefault("discovered", now)
            for state in ("evaluating", "awaiting_approval", "approved", "canary", "champion"):
                if v.state == state or (state == "evaluating" and v.state != "registered"):
                    marks.setdefault(f"state_{state}", now)
        if p is not None:
            marks.setdefault(f"promotion_{p.state}", now)
        for nid, served in nodes.items():
            if served == version:
                marks.setdefault(f"{nid}_serves", now)
        time.sleep(0.05)


def _hot_swaps(st, versions: tuple[str, str], swaps: int, admin_token: str) -> tuple[list[float], list[float]]:
    """Alternate the two versions on every node through its admin endpoint; (pause ms, answer s) per load."""
    import httpx

    pauses, answer_s = [], []
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {admin_token}"}) as c:
        for i in range(swaps):
            v = versions[i % 2]
            rv = st.registry.get(v)
            sha = _state_row(st.workers.sessions, v).manifest_sha256
            for sn in list(st.nodes.values()):
                t = time.perf_counter()
                r = c.post(f"{sn.url}/admin/drafter", json={"version": v, "uri": rv.source, "sha256": sha})
                answer_s.append(time.perf_counter() - t)
                r.raise_for_status()
                pauses.append(r.json()["pause_ms"])
    return pauses, answer_s


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _served(st) -> dict[str, str | None]:
    out = {}
    for nid, sn in sorted(st.nodes.items()):
        try:
            out[nid] = sn.drafter()["version"]
        except Exception:
            out[nid] = None
    return out


def _state_row(sessions, v):
    from controlplane.models import Version

    with sessions() as s:
        return s.get(Version, v)


def _state(sessions, v) -> str | None:
    row = _state_row(sessions, v)
    return row.state if row else None


def _wait(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not reached in {timeout:g} s")
        time.sleep(0.1)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = result["milestones_s"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    names = list(marks)
    ax.barh(range(len(names)), [marks[n] for n in names], color="tab:blue")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the candidate was registered")
    ax.axvline(GOAL_LATENCY_S, color="red", ls=":", label=f"goal {GOAL_LATENCY_S:g} s")
    ax.set_title(f"promotion timeline ({result['target_id']}): {result['promotion_latency_s']:.1f} s")
    ax.legend(fontsize=8)
    p = result["swap_pause_ms"]
    bx.bar(["p50", "p99", "max"], [p["p50"] or 0, p["p99"] or 0, p["max"] or 0], color="tab:green")
    bx.axhline(GOAL_PAUSE_MS, color="red", ls=":", label=f"goal {GOAL_PAUSE_MS:g} ms")
    bx.set_ylabel("serving pause at swap (ms)")
    bx.set_title(f"{p['n']} hot swaps")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", choices=["tiny", "real"], default="tiny",
                    help="tiny random target with the real tokenizer, or the real SmolLM2-135M")
    ap.add_argument("--out", type=Path, default=Path("out/bench-promotion"))
    ap.add_argument("--swaps", type=int, default=20)
    ap.add_argument("--watch-s", type=float, default=3.0)
    ap.add_argument("--records", type=int, default=24)


def _run_args(a: argparse.Namespace, settings=None) -> int:
    result = run(a.target, a.out, a.swaps, a.watch_s, a.records)
    print(json.dumps(result, indent=2))
    return 0


def register_bench(bsub: argparse._SubParsersAction) -> None:
    """``adaflash bench promotion``."""
    p = bsub.add_parser("promotion", help="promotion latency and swap pause on the embedded control plane")
    _arguments(p)
    p.set_defaults(func=_run_args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _arguments(ap)
    return _run_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
