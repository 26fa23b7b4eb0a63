"""A small but genuine drafter artifact directory: safetensors weights, config, manifest."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from adaflash.contracts.manifest import Lineage, Manifest, OffsetRange, TargetIdentity, sha256_file

TARGET = "tiny-target"


def online_lineage(now: datetime | None = None, tenants=("acme", "globex")) -> Lineage:
    now = now or datetime.now(UTC)
    return Lineage(topic="adaflash.feedback.v1", offsets=[OffsetRange(partition=0, start=0, end=99)],
                   tenants=list(tenants), window_start=now - timedelta(days=1), window_end=now,
                   parent_version="1", source="online")


def make_drafter_dir(directory: Path, seed: int = 0, target: str = TARGET, lineage: Lineage | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"fc.weight": rng.standard_normal((8, 16)).astype(np.float32),
               "head.weight": rng.standard_normal((4, 8)).astype(np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"hidden_size": 16, "layers": 1, "seed": seed}))
    files = {name: sha256_file(directory / name) for name in ("model.safetensors", "config.json")}
    manifest = Manifest(target=TargetIdentity(id=target, sha256="0" * 64), block_size=16,
                        drafter={"hidden_size": 16}, length_head={"bins": 16}, files=files,
                        lineage=lineage or online_lineage())
    (directory / "manifest.json").write_text(manifest.model_dump_json(indent=1))
    return directory
