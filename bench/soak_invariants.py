"""The soak's invariants over what the fleet did: records, offsets, the fleet's end state, streams.

Each function is pure (the soak collects its inputs with ``bench/soak_probe.py``) and
returns ``{"held": bool, ...counts}``, so a synthetic run can show each one failing.

- ``records_accounted``: every feedback record the nodes emitted (scrubbed and handed to
  the producer) is either in a learner's ledger (``seen``: trained, expired, opted out;
  de-duplicated by record id across learners), in the DLQ, or still pending (in a node's
  spool, or in Kafka behind the group's committed offset). Records the nodes dropped
  before emitting are counted by their stated cause (the ``reason`` label: policy,
  sampling, scrub failure or timeout, spool overflow, ...). ``unaccounted`` is what is
  left; the invariant holds when it is zero. Pending is an upper bound (a record trained
  whose offset commit had not gone through is counted in the ledger and in the lag), so
  the check can only err towards holding by that many records, reported as ``pending``.
- ``ledgers_match_offsets``: the learner group's committed offset on each partition of
  the feedback topic is the next offset one learner's ledger stored for it (the learner
  commits to Kafka only what its checkpoint stored), and, when the broker kept its log
  through the run, the records finished in the ledgers fit below the committed offsets.
- ``fleet_converged``: every node serves the version the control plane wants for it
  (none wanted: it keeps what it serves), the audit chain verifies, and each version's
  state and the champion/previous aliases agree between the database and MLflow.
- ``no_hung_stream``: every streaming request ended (finished, refused, or dropped by
  the client on purpose) within ``bound_s``; none was still open when the traffic stopped.
"""

from __future__ import annotations

STREAM_KINDS = ("stream", "disconnect")


def records_accounted(nodes: dict, ledgers: dict, kafka: dict | None, topic: dict | None = None) -> dict:
    """``nodes``: {emitted, dropped: {reason: n}, spool_pending}; ``ledgers``: {consumed (distinct
    record ids), by_outcome, ids}; ``kafka``: {committed, lag, dlq} or None when the broker could
    not be read; ``topic``: ``soak_probe.topic_positions`` (every record the broker kept and the
    DLQ's sources) or None. Each record in the topic before its partition's committed offset
    must be in a ledger or the DLQ (``lost_by_learners`` lists the first that are not)."""
    emitted = int(nodes.get("emitted", 0))
    consumed = int(ledgers.get("consumed", 0))
    lag = None if kafka is None else int(kafka.get("lag", 0))
    dlq = 0 if kafka is None else int(kafka.get("dlq", 0))
    pending = int(nodes.get("spool_pending", 0)) + (lag or 0)
    unaccounted = max(0, emitted - consumed - dlq - pending)
    out = {"emitted": emitted, "consumed_once": consumed, "by_outcome": ledgers.get("by_outcome", {}),
           "dlq": dlq, "pending": pending, "pending_spool": int(nodes.get("spool_pending", 0)),
           "pending_kafka": lag, "dropped_at_node": dict(sorted(nodes.get("dropped", {}).items())),
           "submitted": nodes.get("submitted"), "unaccounted": unaccounted,
           "in_ledgers_not_counted_emitted": max(0, consumed - emitted),
           "node_processes": nodes.get("processes")}
    lost: list = []
    if topic is not None and kafka is not None:
        ids, committed = ledgers.get("ids", set()), kafka.get("committed", {})
        recs, sources = topic["records"], topic["dlq_sources"]
        distinct = {r for r in recs.values() if r is not None}
        lost = sorted(pos for pos, rid in recs.items() if pos[1] < committed.get(pos[0], 0)
                      and pos not in sources and (rid is None or rid not in ids))
        out |= {"in_topic": len(recs), "distinct_in_topic": len(distinct),
                "sent_twice_to_topic": len(recs) - len(distinct) - sum(1 for r in recs.values() if r is None),
                "dlq_distinct_sources": len(sources), "lost_by_learners": len(lost),
                "lost_positions": [list(p) for p in lost[:20]]}
    out["held"] = kafka is not None and topic is not None and emitted > 0 and unaccounted == 0 and not lost
    return out


def ledgers_match_offsets(committed: dict[int, int] | None, stored: dict[str, dict[int, int]],
                          finished: int, broker_restarted: bool) -> dict:
    """``committed``: the group's offsets per partition (None: unreadable); ``stored``: per learner,
    the next offset its ledger keeps per partition; ``finished``: records in the ledgers."""
    if committed is None:
        return {"held": False, "committed": None, "stored": stored, "reason": "group offsets unreadable"}
    mismatched = {p: {"committed": o, "stored": {n: s.get(p) for n, s in stored.items()}}
                  for p, o in committed.items() if o > 0 and o not in {s.get(p) for s in stored.values()}}
    total = sum(o for o in committed.values() if o > 0)
    fits = broker_restarted or finished <= total
    return {"held": not mismatched and fits, "committed": committed, "committed_total": total,
            "finished_in_ledgers": finished, "mismatched": mismatched,
            "count_checked": not broker_restarted}


def fleet_converged(nodes: list[dict], audit: dict | None, db_versions: dict[str, str],
                    mlflow_versions: dict[str, str | None], db_aliases: dict[str, str | None],
                    mlflow_aliases: dict[str, str | None]) -> dict:
    """``nodes``: [{node_id, served_version, desired_version}]; ``audit``: the verify answer;
    versions: {version: state}; aliases: {champion: v, previous: v}."""
    off = [n["node_id"] for n in nodes
           if n.get("desired_version") is not None and n.get("served_version") != n["desired_version"]]
    unserved = [n["node_id"] for n in nodes if n.get("served_version") is None]
    states = {v: {"database": s, "mlflow": mlflow_versions.get(v)} for v, s in db_versions.items()
              if mlflow_versions.get(v) != s}
    aliases = {a: {"database": v, "mlflow": mlflow_aliases.get(a)} for a, v in db_aliases.items()
               if mlflow_aliases.get(a) != v}
    audit_ok = bool(audit and audit.get("ok"))
    return {"held": bool(nodes) and not off and not unserved and audit_ok and not states and not aliases,
            "nodes": {n["node_id"]: {"served": n.get("served_version"), "desired": n.get("desired_version")}
                      for n in nodes},
            "not_serving_desired": off + unserved, "audit_ok": audit_ok,
            "audit_entries": (audit or {}).get("entries"), "versions": len(db_versions),
            "state_mismatches": states, "alias_mismatches": aliases}


def no_hung_stream(events: list[dict], still_open: list[dict], bound_s: float) -> dict:
    """Streams in ``events`` (with ``latency_s``), and requests still open when the traffic stopped."""
    streams = [e for e in events if e["kind"] in STREAM_KINDS]
    slow = [e for e in streams if e["latency_s"] > bound_s or "Timeout" in str(e.get("error") or "")]
    open_streams = [o for o in still_open if o["kind"] in STREAM_KINDS]
    longest = max((e["latency_s"] for e in streams), default=None)
    return {"held": bool(streams) and not slow and not open_streams, "streams": len(streams),
            "over_bound": len(slow), "open_at_stop": len(open_streams), "longest_s": longest,
            "bound_s": bound_s}


def ttft_by_tenant(events: list[dict]) -> dict[str, dict]:
    """TTFT p50/p99 per tenant over the requests that produced a first token."""
    by: dict[str, list[float]] = {}
    for e in events:
        if e.get("ttft_s") is not None:
            by.setdefault(e["tenant"], []).append(e["ttft_s"])
    return {t: {"n": len(xs), "p50_s": pct(xs, 0.5), "p99_s": pct(xs, 0.99)} for t, xs in sorted(by.items())}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None
