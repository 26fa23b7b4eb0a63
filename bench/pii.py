"""``adaflash bench pii``: the scrubber's recall and precision per entity type, and its cost.

A labelled synthetic corpus (``bench.pii_corpus``: Faker values in many locales placed in
introductions, signatures, quoted e-mails, code, logs, mentions and addresses) goes
through the node's scrubber (``governance.pii.Scrubber``, the one the child process runs).

- recall per type: a labelled value counts as caught when the scrubbed text no longer
  contains it. Also ``token_recall``: no word of it with a letter in it is left.
- precision per type: of the spans the scrubber replaced, mapped to a type by entity, the
  share that overlaps a labelled value (of any type: an SSN replaced as a phone number is
  still PII removed); ``precision_same_type`` asks for a label of the same type.
- cost: wall and CPU milliseconds per record on one thread, CPU milliseconds per 1,000
  characters, and what share of one core the scrubber needs at a given rate of finished
  requests (two texts each, of the corpus's length: longer texts cost in proportion).

Writes ``result.json`` and ``plot.png`` (recall and precision per type) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.pii_corpus import REQUIRED, TYPES, Record, generate

TARGET_RECALL = 0.99
# finished requests per second at which the scrubber's share of a core is reported
REQUEST_RATES = (0.5, 1.0, 2.0, 5.0)
MAX_MISSES = 40  # missed values listed in result.json (synthetic values, safe to print)

ENTITY_TYPE = {
    "PERSON": "person", "EMAIL_ADDRESS": "email", "PHONE_NUMBER": "phone", "CREDIT_CARD": "card",
    "ADDRESS": "address", "STREET_ADDRESS": "address", "LOCATION": "address",
    "IP_ADDRESS": "other", "IBAN_CODE": "other", "CRYPTO": "other", "URL": "other", "MEDICAL_LICENSE": "other",
}


def entity_type(entity: str) -> str:
    """The bench's type of a scrubber entity."""
    from governance.pii import NATIONAL_ID_ENTITIES, SECRET_ENTITIES

    if entity in ENTITY_TYPE:
        return ENTITY_TYPE[entity]
    if entity in NATIONAL_ID_ENTITIES:
        return "national_id"
    if entity in SECRET_ENTITIES:
        return "secret"
    return "other"


def register_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("pii", help="PII recall / precision per entity type and scrub cost")
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1, help="corpus seed (0 was used to tune the recognizers)")
    p.add_argument("--out", default="out/bench-pii")
    p.set_defaults(func=main)


def main(args, settings) -> int:
    from adaflash.cli import CliError

    if args.records < 1:
        raise CliError("--records must be positive")
    result = run(args.records, args.seed, Path(args.out), score_threshold=settings.governance.pii_score_threshold)
    print(json.dumps(result, indent=2))
    return 0


def _words(value: str) -> list[str]:
    """Words of a value that give a person away on their own (not digit groups such as the
    "06" of a phone number, which also occur in dates)."""
    return [w for w in re.split(r"[\s\-]+", value) if len(w) >= 2 and re.search(r"[^\W\d_]", w)]


def evaluate(records: list[Record], scrubber) -> dict:
    """Recall, precision and cost of ``scrubber`` (``scrub_spans``) on labelled records."""
    total: Counter[str] = Counter()
    caught: Counter[str] = Counter()
    token_caught: Counter[str] = Counter()
    by_slice: dict[str, Counter] = defaultdict(Counter)  # "type/placement" and "person/locale" -> hit, n
    det: Counter[str] = Counter()
    det_any: Counter[str] = Counter()
    det_same: Counter[str] = Counter()
    misses, false_pos, ms, cpu_ms = [], [], [], []
    for rec in records:
        t0, c0 = time.perf_counter(), time.thread_time()
        result, spans = scrubber.scrub_spans(rec.text)
        ms.append((time.perf_counter() - t0) * 1000)
        cpu_ms.append((time.thread_time() - c0) * 1000)
        for s in rec.spans:
            if s.type == "other":
                continue
            hit = s.value not in result.text
            total[s.type] += 1
            caught[s.type] += hit
            token_caught[s.type] += hit and not any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", result.text)
                                                    for w in _words(s.value))
            for key in (f"{s.type}/{rec.placement}", f"{s.type}/{rec.locale}"):
                by_slice[key]["n"] += 1
                by_slice[key]["hit"] += hit
            if not hit and len(misses) < MAX_MISSES:
                misses.append({"record": rec.id, "type": s.type, "kind": s.kind, "value": s.value,
                               "placement": rec.placement, "locale": rec.locale})
        for start, end, entity in spans:
            t = entity_type(entity)
            det[t] += 1
            over = [s for s in rec.spans if s.start < end and start < s.end]
            det_any[t] += bool(over)
            det_same[t] += any(s.type == t for s in over)
            if not over and len(false_pos) < MAX_MISSES:
                false_pos.append({"record": rec.id, "entity": entity, "text": rec.text[start:end][:80],
                                  "placement": rec.placement})
    per_type = {}
    for t in TYPES:
        if t == "other" and not det[t]:
            continue
        per_type[t] = {"labelled": total[t], "caught": caught[t],
                       "recall": _ratio(caught[t], total[t]), "token_recall": _ratio(token_caught[t], total[t]),
                       "detected": det[t], "precision": _ratio(det_any[t], det[t]),
                       "precision_same_type": _ratio(det_same[t], det[t])}
    low = {k: round(v["hit"] / v["n"], 4) for k, v in sorted(by_slice.items()) if v["hit"] < v["n"]}
    return {"per_type": per_type, "recall_below_1_by_slice": low, "misses": misses, "false_positives": false_pos,
            "ms": ms, "cpu_ms": cpu_ms}


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def run(n: int, seed: int, out: Path, score_threshold: float = 0.3) -> dict:
    os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
    from governance.pii import Scrubber

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records = generate(n, seed)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    scrubber = Scrubber(score_threshold=score_threshold)
    scrubber.scrub("warm up: Jane Doe, jane@example.com")
    load_s = time.perf_counter() - t0
    ev = evaluate(records, scrubber)
    ms, cpu_ms = ev.pop("ms"), ev.pop("cpu_ms")
    mean, cpu_mean = statistics.fmean(ms), statistics.fmean(cpu_ms)
    chars = statistics.fmean(len(r.text) for r in records)
    # wall time suffers from other load on a shared machine; the thread's CPU time does not
    cost = {"ms_per_record_mean": round(mean, 2), "ms_per_record_p50": round(statistics.median(ms), 2),
            "ms_per_record_p95": round(sorted(ms)[int(0.95 * (len(ms) - 1))], 2),
            "cpu_ms_per_record_mean": round(cpu_mean, 2), "cpu_ms_per_1000_chars": round(1000 * cpu_mean / chars, 1),
            "chars_per_record_mean": round(chars, 1), "records_per_core_s": round(1000 / cpu_mean, 1),
            # a feedback record is two texts (prompt, response) of about this length
            "core_fraction_at_requests_per_s": {str(r): round(2 * r * cpu_mean / 1000, 3) for r in REQUEST_RATES},
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}
    pt = ev["per_type"]
    result = {"records": n, "seed": seed, "score_threshold": score_threshold, "target_recall": TARGET_RECALL,
              "required_types": list(REQUIRED),
              "meets_target": all((pt[t]["recall"] or 0) >= TARGET_RECALL for t in REQUIRED if pt[t]["labelled"]),
              "per_type": pt, "cost": cost, "generate_s": round(gen_s, 2), "scrubber_load_s": round(load_s, 2),
              "placements": dict(Counter(r.placement for r in records)),
              "locales": sorted({r.locale for r in records}), "cpu_flags": _cpu_flags(),
              "recall_below_1_by_slice": ev["recall_below_1_by_slice"], "misses": ev["misses"],
              "false_positives": ev["false_positives"]}
    (out / "result.json").write_text(json.dumps(result, indent=2, ensure_ascii=False))
    plot(result, out / "plot.png")
    return result


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({f for f in ("avx512_bf16", "amx_bf16") if re.search(rf"\b{f}\b", text)})


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = result["per_type"]
    types = [t for t in pt if pt[t]["labelled"]]
    x = range(len(types))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.38
    rec = [pt[t]["recall"] or 0 for t in types]
    prec = [pt[t]["precision"] or 0 for t in types]
    ax.bar([i - w / 2 for i in x], rec, w, label="recall (value gone)")
    ax.bar([i + w / 2 for i in x], prec, w, label="precision (replaced spans on a label)")
    ax.axhline(result["target_recall"], color="k", ls="--", lw=1, label=f"target recall {result['target_recall']}")
    for i in x:
        ax.text(i - w / 2, rec[i] + 0.01, f"{rec[i]:.3f}", ha="center", fontsize=7)
        none = pt[types[i]]["precision"] is None  # nothing of this type was replaced
        ax.text(i + w / 2, prec[i] + 0.01, "n/a" if none else f"{prec[i]:.3f}", ha="center", fontsize=7)
    ax.set_xticks(list(x), [f"{t}\n(n={pt[t]['labelled']})" for t in types], fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.legend(fontsize=8, loc="lower left")
    c = result["cost"]
    ax.set_title(f"PII scrubber on {result['records']} synthetic records (seed {result['seed']}): "
                 f"{c['cpu_ms_per_record_mean']} CPU ms/record", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
