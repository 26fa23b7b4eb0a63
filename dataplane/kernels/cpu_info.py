"""What the CPU offers, as /proc/cpuinfo names it: the flags that decide the served
precision (``dataplane.precision``) and which kernels run (``dataplane.kernels.cpu_gemv``)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> list[str]:
    """The CPU features that decide precision and kernels, as /proc/cpuinfo names them."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "fma")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in wanted if f in have]
    return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
