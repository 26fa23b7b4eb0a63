"""CPU seconds used by each live thread of this process (psutil)."""

from __future__ import annotations

import threading

import psutil


def thread_ids() -> set[int]:
    return {t.id for t in psutil.Process().threads()}


def cpu_seconds(tids: set[int] | None = None) -> dict[int, float]:
    """User + system CPU seconds of each live thread of ``tids`` (default: every thread)."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads() if tids is None or t.id in tids}


def thread_name(tid: int) -> str:
    """The Python thread's name where it is one, else the kernel's name for it."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    if tid in names:
        return names[tid]
    try:
        return f"{psutil.Process(tid).name()}:{tid}"
    except psutil.Error:  # the thread ended
        return str(tid)
