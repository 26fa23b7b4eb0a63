"""``adaflash bench soak``: the fleet under mixed traffic while faults are injected.

    adaflash bench soak --minutes 2 --concurrency 4 --tenants 3 \\
        --faults broker,learner,controlplane,node,scrubber,rollback --out out/soak

Starts its own stack under OUT/home (``adaflash up --nodes 2 --learners 2``), gives the
flooding tenant a small queue limit, runs the traffic of ``bench/soak_traffic.py`` for
``--minutes`` while ``bench/soak_faults.py`` injects the faults evenly spread over the run,
stops the stack and checks invariants. Writes result.json (with ``invariants``: each
``held`` and its counts) and timeline.png to OUT, prints the JSON, and exits non-zero
when an invariant failed.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time
from pathlib import Path

from bench import soak_invariants as checks
from bench import soak_probe as probe
from bench.soak_faults import FAULTS, Injector
from bench.soak_plot import plot
from bench.soak_probe import FeedbackScraper
from bench.soak_traffic import FLOOD_TENANT, Traffic, is_json_error, load_prompts

FLOOD_MAX_QUEUED = 2
FLOOD_MAX_TOKENS = 100


def start_stack(settings, nodes: int, learners: int, database: str, timeout_s: float) -> dict:
    import stack

    extra = ["--random-ports", "--only", ",".join(stack.ALL_PARTS), "--nodes", str(nodes),
             "--learners", str(learners), "--database", database]
    pid = stack.spawn_detached(settings, None, extra)
    try:
        return stack.wait_ready(settings, pid, timeout_s)
    except stack.StackError:
        stack.down(settings)
        raise


def _corrupted(inj: Injector, settings, wait_s: float = 60.0) -> dict | None:
    """The corrupted candidates' fate, waiting a while for the control plane to judge them."""
    if not inj.corrupted:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = inj.corrupted_outcome()
        except Exception as e:  # noqa: BLE001 - reported as not held
            out = {v: {"state": f"unknown ({type(e).__name__})", "served_by": []} for v in inj.corrupted}
        if all(o["state"] in REFUSED for o in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(2.0)


REFUSED = ("rejected", "gate_failed")


def invariants(events: list[dict], faults: list[dict], home: Path, slo_ttft_s: float, left: list[int],
               learner_dirs: list[Path], final_states: dict, corrupted: dict | None = None,
               flood: bool = True) -> dict:
    fair = [e for e in events if e["tenant"] != FLOOD_TENANT and e["kind"] != "malformed"]
    failed = [e for e in fair if e["status"] != 200]
    malformed = [e for e in events if e["kind"] == "malformed"]
    bad_malformed = [e for e in malformed if not (400 <= e["status"] < 500 and is_json_error(e))]
    flooded = [e for e in events if e["tenant"] == FLOOD_TENANT]
    ttft = [e["ttft_s"] for e in fair if e["ttft_s"] is not None]
    p99 = checks.pct(ttft, 0.99)
    ledgers, dup, cross = {}, 0, 0
    for d in learner_dirs:
        ids = _ledger(d / "state.db")
        ledgers[d.name] = len(ids)
        dup += len(ids) - len(set(ids))
    sets = [set(_ledger(d / "state.db")) for d in learner_dirs]
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            cross += len(sets[i] & sets[j])
    killed = [f for f in faults if f["ok"] and f["name"] in ("broker", "learner", "controlplane", "node")]
    return {
        "well_formed_requests_served": {"held": not failed and bool(fair), "requests": len(fair),
                                        "failed_after_retry": len(failed),
                                        "retried": sum(e["retried"] for e in fair),
                                        "errors": sorted({str(e["error"]) for e in failed})[:10]},
        "malformed_get_4xx_json": {"held": not bad_malformed, "requests": len(malformed),
                                   "not_4xx_json": len(bad_malformed)},
        "flood_is_isolated": {"held": (not flood or (bool(flooded) and any(e["status"] == 429 for e in flooded)))
                              and p99 is not None and p99 <= slo_ttft_s, "flood": flood,
                              "flood_requests": len(flooded),
                              "flood_429": sum(e["status"] == 429 for e in flooded),
                              "others_ttft_p99_s": p99, "slo_ttft_s": slo_ttft_s},
        "killed_parts_recovered": {"held": all(f["recovered_s"] is not None for f in killed)
                                   and all(s == "ready" for s in final_states.values()),
                                   "killed": len(killed),
                                   "recovered_s": {f["name"]: f["recovered_s"] for f in killed},
                                   "final_states": final_states},
        "no_record_trained_twice": {"held": dup == 0 and cross == 0, "ledgers": ledgers,
                                    "duplicates_within": dup, "shared_between_learners": cross},
        "no_process_left": {"held": not left, "left": left},
    } | ({} if corrupted is None else {"corrupted_candidate_refused": {
        "held": all(o["state"] in REFUSED and not o["served_by"] for o in corrupted.values()),
        "versions": corrupted}})


def _ledger(path: Path) -> list[str]:
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r for (r,) in db.execute("SELECT record_id FROM trained")]
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()


def _learners_catch_up(ep: dict, k, within_s: float) -> dict:
    """After the traffic: the group's lag on the feedback topic must reach 0 within ``within_s``
    (a partial buffer trains after learner.max_wait_s; stale records are shed after
    learner.max_record_age_s). A learner that stopped consuming
    leaves its records pending for ever, which the records count alone would call accounted."""
    t0 = time.monotonic()
    first = last = probe.kafka_offsets(ep["kafka_bootstrap"], k.feedback_topic, k.dlq_topic, k.consumer_group)
    while time.monotonic() - t0 < within_s and (last is None or last["lag"] > 0):
        time.sleep(2.0)
        last = probe.kafka_offsets(ep["kafka_bootstrap"], k.feedback_topic, k.dlq_topic, k.consumer_group)
    lag = None if last is None else last["lag"]
    return {"held": lag == 0, "lag_when_traffic_stopped": None if first is None else first["lag"],
            "lag": lag, "waited_s": round(time.monotonic() - t0, 1), "within_s": within_s}


def _final_checks(settings, ep: dict, admin: str, scraper: FeedbackScraper, learner_dirs: list[Path],
                  broker_restarted: bool, wait_s: float = 60.0) -> dict:
    """The records, offsets and fleet invariants, read while the stack still runs. The fleet is
    given ``wait_s`` to converge (a node picking up a new champion, MLflow mirroring a state)."""
    k = settings.kafka
    # a learner behind its traffic sheds what is older than max_record_age_s: it is caught up once
    # the last records it read are trained or that old (and its current step is done)
    age = settings.learner.max_record_age_s
    caught_up = _learners_catch_up(ep, k, max(60.0, settings.learner.max_wait_s + 30.0) + (age + 120.0 if age else 0.0))
    scraper.stop()
    kafka = led = None
    for _ in range(5):  # a snapshot of the ledgers between two equal reads of the group's offsets
        k1 = probe.kafka_offsets(ep["kafka_bootstrap"], k.feedback_topic, k.dlq_topic, k.consumer_group)
        led = probe.ledgers(learner_dirs)
        kafka = probe.kafka_offsets(ep["kafka_bootstrap"], k.feedback_topic, k.dlq_topic, k.consumer_group)
        if k1 is not None and kafka is not None and k1["committed"] == kafka["committed"]:
            break
        time.sleep(2.0)
    topic = probe.topic_positions(ep["kafka_bootstrap"], k.feedback_topic, k.dlq_topic)
    out = {"learners_caught_up": caught_up,
           "records_accounted": checks.records_accounted(scraper.totals(), led, kafka, topic),
           "ledgers_match_offsets": checks.ledgers_match_offsets(
               None if kafka is None else kafka["committed"], led["stored_offsets"],
               sum(led["by_outcome"].values()), broker_restarted)}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fleet = checks.fleet_converged(**probe.fleet_state(settings, ep["controlplane_api"], admin,
                                                               ep["mlflow_tracking_uri"]))
        except Exception as e:  # noqa: BLE001 - reported as not held
            fleet = {"held": False, "error": f"{type(e).__name__}: {e}"}
        if fleet["held"] or time.monotonic() > deadline:
            return out | {"fleet_converged": fleet}
        time.sleep(3.0)


def run(settings, minutes: float, concurrency: int, tenants: int, faults: list[str], out: Path,
        slo_ttft_s: float = 30.0, database: str = "sqlite", ready_timeout_s: float = 900.0,
        flood: bool = True, stream_bound_s: float = 120.0) -> dict:
    import stack
    from adaflash.controlplane_client import ControlPlaneClient
    from adaflash.credentials import read_file

    out.mkdir(parents=True, exist_ok=True)
    state = start_stack(settings, 2, 2, database, ready_timeout_s)
    ep = state["endpoints"]
    home = Path(ep["state_dir"])
    learner_dirs = [home / "learner", home / "learner-2"]
    admin = read_file(ep["admin_token_file"]) or ""
    if flood:  # the flooding tenant may hold two requests in flight (prompt + max_tokens ~ 45 tokens each)
        with ControlPlaneClient(ep["controlplane_url"], admin, timeout_s=10) as cp:
            cp.set_tenant_policy(FLOOD_TENANT, max_queued=FLOOD_MAX_QUEUED, max_tokens=FLOOD_MAX_TOKENS)
    traffic = Traffic(ep["dataplane_urls"], tenants, concurrency, load_prompts(), flood_threads=4 if flood else 0,
                      node_admin_token=admin)  # the fleet's nodes take the stack's admin key (stack/plan.py)
    duration = minutes * 60.0
    # a rollback waiting for a promotion gives up with a twentieth of the run (at least 5 s)
    # left; the fleet converges on the version it went back to (fleet_converged allows 60 s more)
    inj = Injector(settings, traffic.now, admin, rollback_by=duration - max(5.0, duration / 20))
    scraper = FeedbackScraper(settings, ep["dataplane_urls"], clock=traffic.now)
    traffic.start()
    scraper.start()
    try:
        for i, name in enumerate(faults):
            at = (i + 1) * duration / (len(faults) + 1)
            time.sleep(max(0.0, at - traffic.now()))
            inj.inject(name)
        time.sleep(max(0.0, duration - traffic.now()))
    finally:
        traffic.stop()
        inj.wait(timeout_s=120)
        final = {n: p.get("state") for n, p in stack.live_status(settings).get("processes", {}).items()
                 if p.get("state") not in ("missing", "external")}
        corrupted = _corrupted(inj, settings)
        try:
            late = _final_checks(settings, ep, admin, scraper, learner_dirs,
                                 any(f["ok"] and f["name"] == "broker" for f in inj.records()))
        finally:
            res = stack.down(settings)
    events, fault_rows = traffic.summary(), inj.records()
    inv = invariants(events, fault_rows, home, slo_ttft_s, res["leftover"], learner_dirs, final, corrupted,
                     flood=flood) | late
    inv["no_hung_stream"] = checks.no_hung_stream(events, traffic.still_open(), stream_bound_s)
    result = {"minutes": minutes, "concurrency": concurrency, "tenants": tenants, "faults_requested": faults,
              "flood": flood, "database": database,
              "endpoints": {k: ep.get(k) for k in ("dataplane_urls", "node_ids", "learner_ids", "database_url")},
              "faults": fault_rows, "ttft_by_tenant": checks.ttft_by_tenant(events),
              "invariants": inv, "stuck_requests": traffic.stuck, "events": events, "timeline": scraper.samples}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, out / "timeline.png")
    return result


def register_bench(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("soak", help="the fleet under mixed traffic and injected faults (invariants, timeline)")
    s.add_argument("--minutes", type=float, default=2.0)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--tenants", type=int, default=3)
    s.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    s.add_argument("--slo-ttft-s", type=float, default=30.0, help="TTFT p99 the non-flooding tenants must keep")
    s.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    s.add_argument("--no-flood", action="store_true", help="traffic without the flooding tenant (a baseline)")
    s.add_argument("--stream-bound-s", type=float, default=120.0, help="every stream must end within this")
    s.add_argument("--out", default="out/soak")
    s.set_defaults(func=_cli)


def _cli(args, settings) -> int:
    from adaflash.cli import CliError
    from adaflash.config import load_config

    faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        raise CliError(f"unknown fault(s) {bad}; choose from {', '.join(FAULTS)}")
    if args.minutes <= 0 or args.concurrency < 1 or args.tenants < 1:
        raise CliError("--minutes, --concurrency and --tenants must be positive")
    out = Path(args.out).resolve()
    settings = load_config(args.config, home=out / "home")
    result = run(settings, args.minutes, args.concurrency, args.tenants, faults, out, args.slo_ttft_s,
                 args.database, flood=not args.no_flood, stream_bound_s=args.stream_bound_s)
    summary = {k: v for k, v in result.items() if k != "events"}
    print(json.dumps(summary, indent=2, default=str))
    return 0 if all(v["held"] for v in result["invariants"].values()) else 1
