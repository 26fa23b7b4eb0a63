"""Where evaluation reports and plots live on disk."""

from __future__ import annotations

from pathlib import Path

from adaflash.config import Settings


def evaluations_dir(settings: Settings) -> Path:
    cfg = settings.controlplane
    return (Path(cfg.evaluations_dir) if cfg.evaluations_dir else Path(settings.home) / "evaluations").resolve()
