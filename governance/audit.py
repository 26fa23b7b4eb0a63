"""Append-only, hash-chained audit entries: pure functions shared by every store.

Each entry's hash covers its canonical JSON body and the previous entry's hash, so
editing, deleting or reordering any entry breaks verification from that point on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

GENESIS = "0" * 64


def canonical(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)


def chain_hash(prev_hash: str, body: Mapping[str, Any]) -> str:
    """sha256(prev_hash || canonical(body)) as hex."""
    return hashlib.sha256((prev_hash + canonical(body)).encode()).hexdigest()


def verify_chain(entries: Iterable[tuple[Mapping[str, Any], str, str]]) -> tuple[bool, int | None]:
    """Check ``(body, prev_hash, hash)`` triples in order.

    Returns ``(True, None)`` if intact, else ``(False, index of the first bad entry)``.
    """
    expected_prev = GENESIS
    for i, (body, prev_hash, digest) in enumerate(entries):
        if prev_hash != expected_prev or chain_hash(prev_hash, body) != digest:
            return False, i
        expected_prev = digest
    return True, None
