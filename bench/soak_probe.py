"""What the soak reads from the running fleet for its invariants (``bench/soak_invariants.py``).

- ``FeedbackScraper``: every ``interval_s`` (2 s) it GETs each node's /metrics and keeps,
  per node *process* (the node's name and the supervisor's restart count for it), the
  largest value seen of ``adaflash_feedback_emitted``, ``_submitted`` and ``_dropped`` (by
  reason). A node killed and restarted starts its counters at zero in a new process, so
  the run's totals are the sums of the per-process maxima; what a process counted after
  its last scrape and before it died is missed (at most ``interval_s`` of records, which
  then show as unaccounted, never hidden). The spool depth is the last one each node
  reported (the spool is a file and survives a restart). Each scrape is also kept as a
  sample for the timeline (``samples``: time, node, spool depth, generated tokens, served
  drafter version).
- ``ledgers``: each learner's state.db: the distinct record ids it finished (``seen``,
  by outcome), the ``trained`` ledger, and the next offsets it stored per partition.
- ``kafka_offsets``: the learner group's committed offsets and the end offsets of the
  feedback topic, and the DLQ's length, read before the stack goes down.
- ``topic_positions``: every record of the feedback topic by position and the source
  positions the DLQ holds, so each record the broker kept is traced to a ledger or the DLQ.
- ``fleet_state``: the control plane's nodes (served and desired version), the audit
  chain's verification, and each version's state and aliases in the database and MLflow.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx

from adaflash.controlplane_client import ControlPlaneClient

NODE_PARTS = ("dataplane", "dataplane-2")


def parse_feedback(text: str) -> dict:
    """Totals of the feedback counters in one /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"emitted": 0.0, "submitted": 0.0, "dropped": {}, "spool": 0.0, "tokens": 0.0, "version": None}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "adaflash_feedback_emitted_total":
                out["emitted"] += s.value
            elif s.name == "adaflash_feedback_submitted_total":
                out["submitted"] += s.value
            elif s.name == "adaflash_feedback_dropped_total":
                r = s.labels.get("reason", "?")
                out["dropped"][r] = out["dropped"].get(r, 0.0) + s.value
            elif s.name == "adaflash_feedback_spool_records":
                out["spool"] = s.value
            elif s.name == "adaflash_generated_tokens_total":
                out["tokens"] += s.value
            elif s.name == "adaflash_drafter_info" and s.value == 1:
                out["version"] = s.labels.get("version")
    return out


class FeedbackScraper:
    def __init__(self, settings, urls: list[str], interval_s: float = 2.0, clock=time.monotonic):
        self.settings, self.urls, self.interval_s, self.clock = settings, urls, interval_s, clock
        self.samples: list[dict] = []  # {t, node, spool, tokens, version} per scrape, for the timeline
        self.maxima: dict[tuple[str, int], dict] = {}  # (node part, incarnation) -> largest counters
        self.spool: dict[str, float] = {}
        self._incarnation: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-scraper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """One last scrape, then stop (call before the stack goes down)."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.scrape()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scrape()

    def scrape(self) -> None:
        from stack import live_status

        procs = live_status(self.settings).get("processes", {})
        for part, url in zip(NODE_PARTS, self.urls, strict=False):
            restarts = int((procs.get(part) or {}).get("restarts", 0))
            try:
                page = parse_feedback(httpx.get(f"{url}/metrics", timeout=5).text)
            except (httpx.HTTPError, ValueError):
                continue  # the node is down: its last scrape stands
            self.samples.append({"t": round(self.clock(), 2), "node": part, "spool": page["spool"],
                                 "tokens": page["tokens"], "version": page["version"]})
            self.observe(part, restarts, page)

    def observe(self, part: str, restarts: int, page: dict) -> None:
        inc = max(restarts, self._incarnation.get(part, 0))
        prev = self.maxima.get((part, inc))
        if prev is not None and page["emitted"] + page["submitted"] < prev["emitted"] + prev["submitted"]:
            inc += 1  # counters went back: a new process the supervisor has not reported yet
            prev = None
        self._incarnation[part] = inc
        if prev is None:
            self.maxima[(part, inc)] = {"emitted": page["emitted"], "submitted": page["submitted"],
                                        "dropped": dict(page["dropped"])}
        else:
            prev["emitted"] = max(prev["emitted"], page["emitted"])
            prev["submitted"] = max(prev["submitted"], page["submitted"])
            for r, n in page["dropped"].items():
                prev["dropped"][r] = max(prev["dropped"].get(r, 0.0), n)
        self.spool[part] = page["spool"]

    def totals(self) -> dict:
        dropped: dict[str, int] = {}
        for m in self.maxima.values():
            for r, n in m["dropped"].items():
                dropped[r] = dropped.get(r, 0) + int(n)
        return {"emitted": int(sum(m["emitted"] for m in self.maxima.values())),
                "submitted": int(sum(m["submitted"] for m in self.maxima.values())),
                "dropped": dropped, "spool_pending": int(sum(self.spool.values())),
                "processes": len(self.maxima)}


def ledgers(learner_dirs: list[Path]) -> dict:
    """Distinct finished record ids across learners, by outcome; stored offsets per learner."""
    outcomes: dict[str, str] = {}
    stored: dict[str, dict[int, int]] = {}
    for d in learner_dirs:
        path = d / "state.db"
        if not path.exists():
            continue
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            for rid, outcome in db.execute("SELECT record_id, outcome FROM seen"):
                if outcomes.get(rid) != "trained":  # one learner trained it, the other skipped it
                    outcomes[rid] = outcome
            stored[d.name] = {int(p): int(o) for p, o in db.execute("SELECT partition, next_offset FROM offsets")}
        except sqlite3.OperationalError:
            stored[d.name] = {}
        finally:
            db.close()
    by: dict[str, int] = {}
    for o in outcomes.values():
        by[o] = by.get(o, 0) + 1
    return {"consumed": len(outcomes), "by_outcome": by, "stored_offsets": stored, "ids": set(outcomes)}


def kafka_offsets(bootstrap: str, topic: str, dlq_topic: str, group: str, timeout_ms: int = 10_000) -> dict | None:
    """{committed: {partition: offset}, lag, dlq} or None when the broker cannot be read."""
    from kafka import KafkaAdminClient, TopicPartition
    from kafka.admin import OffsetSpec

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="adaflash-soak",
                                 request_timeout_ms=timeout_ms)
    except Exception:  # noqa: BLE001 - unreadable is reported, not raised
        return None
    try:
        def parts(t: str) -> list:
            return [TopicPartition(t, p["partition_index"]) for d in admin.describe_topics([t])
                    for p in d["partitions"]]

        tps, dlq = parts(topic), parts(dlq_topic)
        ends = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps + dlq})
        got = admin.list_group_offsets({group: tps}).get(group, {})
        committed = {tp.partition: (got[tp].offset if tp in got and got[tp].offset >= 0 else 0) for tp in tps}
        lag = sum(max(0, ends[tp].offset - committed[tp.partition]) for tp in tps)
        return {"committed": committed, "lag": lag, "dlq": sum(ends[tp].offset for tp in dlq)}
    except Exception:  # noqa: BLE001
        return None
    finally:
        admin.close()


def fleet_state(settings, api: str, admin: str, mlflow_uri: str) -> dict:
    """Inputs of ``fleet_converged``: nodes, audit verification, database and MLflow versions."""
    from controlplane.registry import Registry
    from dataplane.target_cache import ensure_target, target_identity

    with ControlPlaneClient(api, admin) as cp:
        nodes = []
        for n in cp.list_nodes():
            d = cp.desired(n.node_id)
            nodes.append({"node_id": n.node_id, "served_version": n.served_version,
                          "desired_version": d.version if d else None})
        audit = cp.verify_audit().model_dump(mode="json")
        versions = cp.list_versions(limit=500)
    db_versions = {v.version: v.state for v in versions}
    db_aliases = {a: next((v.version for v in versions if a in v.aliases), None) for a in ("champion", "previous")}
    reg = Registry(mlflow_uri, target_identity(ensure_target(settings))["id"])
    rvs = reg.list_versions()
    from adaflash.contracts.registry import TAG_STATE

    ml_versions = {rv.version: rv.tags.get(TAG_STATE) for rv in rvs}
    # asked one by one: MLflow's version search leaves every version's aliases empty (mlflow#9783)
    ml_aliases = {a: reg.alias(a) for a in ("champion", "previous")}
    return {"nodes": nodes, "audit": audit, "db_versions": db_versions, "mlflow_versions": ml_versions,
            "db_aliases": db_aliases, "mlflow_aliases": ml_aliases}


def topic_positions(bootstrap: str, topic: str, dlq_topic: str, timeout_s: float = 30.0) -> dict | None:
    """Every record of the feedback topic by position, and the source positions the DLQ holds:
    {records: {(partition, offset): record id or None}, dlq_sources: {(partition, offset)}};
    None when the broker cannot be read to its end within ``timeout_s``."""
    import json as _json

    from kafka import KafkaConsumer, TopicPartition

    try:
        c = KafkaConsumer(bootstrap_servers=bootstrap, client_id="adaflash-soak-reader", enable_auto_commit=False,
                          group_id=None, consumer_timeout_ms=2000)
    except Exception:  # noqa: BLE001 - unreadable is reported, not raised
        return None
    try:
        tps = [TopicPartition(t, p) for t in (topic, dlq_topic) for p in sorted(c.partitions_for_topic(t) or ())]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ends = c.end_offsets(tps)
        records: dict[tuple[int, int], str | None] = {}
        dlq: set[tuple[int, int]] = set()
        deadline = time.monotonic() + timeout_s
        while any(c.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                return None
            for tp, msgs in c.poll(timeout_ms=1000).items():
                for m in msgs:
                    if tp.topic == topic:
                        try:
                            records[(m.partition, m.offset)] = _json.loads(m.value)["record_id"]
                        except (ValueError, KeyError, TypeError):
                            records[(m.partition, m.offset)] = None
                    else:
                        h = {k: v.decode() for k, v in (m.headers or [])}
                        if h.get("source_topic") == topic:
                            dlq.add((int(h["source_partition"]), int(h["source_offset"])))
        return {"records": records, "dlq_sources": dlq}
    except Exception:  # noqa: BLE001
        return None
    finally:
        c.close()
