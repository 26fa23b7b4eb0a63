"""Loading the target for serving: one place that owns threads, device and precision.

Every part that runs the target as a node serves it (the node, shadow evaluation,
benchmarks) loads it here, so that all of them use the precision ``model.dtype``
resolves to on this machine (``dataplane.precision``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaflash.config import Settings
from dataplane.model import TargetModel
from dataplane.precision import PrecisionChoice, choose
from dataplane.target_cache import ensure_target


def serving_precision(settings: Settings, device: str = "cpu") -> PrecisionChoice:
    """The precision nodes on this machine serve in (cached per machine)."""
    apply_threads(settings)
    return choose(settings.model.dtype, device, settings.cache)


def apply_threads(settings: Settings) -> None:
    if settings.model.torch_threads:
        torch.set_num_threads(settings.model.torch_threads)


def load_target(settings: Settings, target_dir: Path | None = None, dtype: torch.dtype | None = None,
                device: str = "cpu") -> TargetModel:
    """The target in the served precision (or ``dtype``), fused for serving on first forward."""
    apply_threads(settings)
    d = target_dir or ensure_target(settings)
    dtype = dtype or serving_precision(settings, device).torch_dtype
    return TargetModel.from_pretrained(d, dtype=dtype, device=device)
