"""What the CPU offers, as /proc/cpuinfo names it: the flags that decide the served
precision (``dataplane.precision``) and which kernels run (``dataplane.kernels.cpu_gemv``)."""

from __future__ import annotations

import os
from pathlib import Path

WANTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "fma")


def _field(name: str) -> str | None:
    """The value of the first /proc/cpuinfo line named ``name``; None where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name) and ":" in ln), None)


def cpu_flags() -> list[str]:
    """The CPU features that decide precision and kernels, as /proc/cpuinfo names them."""
    have = set((_field("flags") or "").split())
    return [f for f in WANTED_FLAGS if f in have]


def cpu_model() -> str:
    return _field("model name") or "unknown"


def machine_busy() -> bool:
    """More runnable work than cores (1-minute load average): a measurement taken now is not kept."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False
