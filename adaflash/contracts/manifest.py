"""manifest.json of a drafter artifact (drafter + length head), shared by all parts.

A node refuses weights whose sha256 or shapes do not match the manifest and keeps
serving what it had.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from adaflash.contracts import MANIFEST_FORMAT


class TargetIdentity(BaseModel):
    id: str
    sha256: str


class OffsetRange(BaseModel):
    partition: int
    start: int  # first offset used, inclusive
    end: int  # last offset used, inclusive


class Lineage(BaseModel):
    model_config = ConfigDict(extra="allow")
    topic: str | None = None
    offsets: list[OffsetRange] = Field(default_factory=list)
    tenants: list[str] = Field(default_factory=list)
    window_start: datetime | None = None
    window_end: datetime | None = None
    parent_version: str | None = None
    source: str = "online"  # online | offline | random


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: str = MANIFEST_FORMAT
    version: str = "0"
    target: TargetIdentity
    block_size: int
    drafter: dict[str, Any]
    length_head: dict[str, Any]
    files: dict[str, str]  # file name -> sha256
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    lineage: Lineage = Field(default_factory=Lineage)
    training: dict[str, Any] = Field(default_factory=dict)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_files(directory: str | Path, manifest: Manifest) -> list[str]:
    """Return a list of problems (empty if every listed file exists with its sha256)."""
    problems = []
    d = Path(directory)
    for name, digest in manifest.files.items():
        p = d / name
        if not p.is_file():
            problems.append(f"missing file {name}")
        elif sha256_file(p) != digest:
            problems.append(f"sha256 mismatch for {name}")
    return problems
