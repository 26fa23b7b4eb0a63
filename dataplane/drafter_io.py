"""Save and load a drafter + length head bundle: model.safetensors, config.json, manifest.json.

Loading checks everything a node must check before it serves new weights: the
manifest's sha256 of every file, the target identity, the shapes against the config,
and that every tensor is finite. Any failure raises ``DrafterLoadError`` with the reason
and leaves the caller's current drafter untouched.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adaflash.contracts.manifest import Lineage, Manifest, TargetIdentity, sha256_file, verify_files
from dataplane.drafter import Drafter, DrafterConfig
from dataplane.model import TargetModel
from dataplane.runner import ModelRunner

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MANIFEST = "manifest.json"


class DrafterLoadError(ValueError):
    """Weights that must not be served; the message says why."""


def save_bundle(drafter: Drafter, directory: str | Path, target_identity: dict, version: str = "0",
                lineage: Lineage | dict | None = None, training: dict | None = None) -> Manifest:
    """Write the bundle atomically (into a temporary folder, then renamed). Returns its manifest."""
    out = Path(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bundle-", dir=out.parent))
    try:
        state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        cfg = drafter.config.to_dict()
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2))
        lin = lineage if isinstance(lineage, Lineage) else Lineage(**(lineage or {}))
        manifest = Manifest(
            version=str(version),
            target=TargetIdentity(**target_identity),
            block_size=drafter.config.block_size,
            drafter={k: v for k, v in cfg.items() if k != "head_hidden"},
            length_head={"hidden": drafter.config.hidden_size, "head_hidden": drafter.config.head_hidden},
            files={WEIGHTS: sha256_file(tmp / WEIGHTS), CONFIG: sha256_file(tmp / CONFIG)},
            lineage=lin,
            training=training or {},
        )
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def read_manifest(directory: str | Path) -> Manifest:
    p = Path(directory) / MANIFEST
    if not p.is_file():
        raise DrafterLoadError(f"no {MANIFEST} in {directory}")
    try:
        return Manifest.model_validate_json(p.read_text())
    except ValueError as e:
        raise DrafterLoadError(f"{MANIFEST} does not validate: {e}") from e


def load_bundle(directory: str | Path, target: TargetModel, target_identity: dict | None = None,
                expected_sha256: str | None = None) -> tuple[Drafter, Manifest]:
    """Load and check a bundle; returns (drafter bound to ``target``, manifest).

    expected_sha256: if given, the sha256 of manifest.json itself must equal it (what a
    control plane pins when it asks a node to load a version).
    """
    d = Path(directory)
    if not d.is_dir():
        raise DrafterLoadError(f"drafter directory {d} does not exist")
    if not (d / MANIFEST).is_file():
        raise DrafterLoadError(f"{d} is not a drafter bundle: it has no {MANIFEST}")
    if expected_sha256 and sha256_file(d / MANIFEST) != expected_sha256:
        raise DrafterLoadError("manifest sha256 does not match the requested sha256")
    manifest = read_manifest(d)
    problems = verify_files(d, manifest)
    if WEIGHTS not in manifest.files or CONFIG not in manifest.files:
        problems.append(f"manifest does not list {WEIGHTS} and {CONFIG}")
    if problems:
        raise DrafterLoadError("; ".join(problems))
    if target_identity and (manifest.target.id, manifest.target.sha256) != (target_identity["id"],
                                                                           target_identity["sha256"]):
        raise DrafterLoadError(f"drafter was trained for target {manifest.target.id} "
                               f"({manifest.target.sha256[:12]}), this node serves {target_identity['id']} "
                               f"({target_identity['sha256'][:12]})")
    try:
        cfg = DrafterConfig.from_dict(json.loads((d / CONFIG).read_text()))
        state = load_file(str(d / WEIGHTS))
    except (ValueError, TypeError, KeyError, SafetensorError, OSError) as e:
        raise DrafterLoadError(f"cannot read drafter files: {e}") from e
    for name, t in state.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise DrafterLoadError(f"tensor {name} holds non-finite values")
    try:
        drafter = Drafter(cfg)
    except (ValueError, TypeError, RuntimeError) as e:
        raise DrafterLoadError(f"config does not build a drafter: {e}") from e
    expected = drafter.state_dict()
    if "vocab_map" in state:
        drafter.vocab_map = torch.empty_like(state["vocab_map"])
        expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad_shape = [n for n in expected if n in state and tuple(state[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or bad_shape:
        raise DrafterLoadError(f"weights do not match the config: missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}, wrong shape {bad_shape[:3]}")
    drafter.load_state_dict(state)
    if drafter.vocab_map.numel() and int(drafter.vocab_map.max()) >= cfg.vocab_size:
        raise DrafterLoadError("vocab_map points outside the target vocabulary")
    ModelRunner.of(target).place(drafter)  # the target's device and precision
    try:
        drafter.bind(target)
    except ValueError as e:
        raise DrafterLoadError(str(e)) from e
    drafter.eval().requires_grad_(False)
    drafter.prepare_serving()  # bfloat16 only; a float32 drafter (the learner's) trains as it is
    return drafter, manifest
