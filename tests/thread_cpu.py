"""CPU seconds used by each live thread of this process (Linux ``/proc/self/task``)."""

from __future__ import annotations

import os
import threading


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def cpu_seconds(tids: set[int] | None = None) -> dict[int, float]:
    """User + system CPU seconds of each live thread of ``tids`` (default: every thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in thread_ids() if tids is None else tids:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[t] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_name(tid: int) -> str:
    """The Python thread's name where it is one, else the kernel's name for it."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    if tid in names:
        return names[tid]
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f"{f.read().strip()}:{tid}"
    except FileNotFoundError:
        return str(tid)
