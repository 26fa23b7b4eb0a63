"""Process groups and ports of the embedded stack's children.

Each child runs in its own session (process group), so stopping it (SIGTERM, then
SIGKILL after a timeout) also reaches what it spawned (the MLflow server's workers);
``adaflash down`` verifies by pid and process group that nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from adaflash.stack_state import pid_alive


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        try:
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
        except (IndexError, ValueError):
            continue
    return out


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(groups: list[tuple[int, int | None]], timeout_s: float) -> list[int]:
    """SIGTERM each (pid, start time) group leader's group, SIGKILL what is left after
    ``timeout_s``; returns pids still alive afterwards (normally none)."""
    live = [(pid, st) for pid, st in groups if pid_alive(pid, st) or group_members(pid)]
    for pid, _ in live:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(group_members(pid) for pid, _ in live):
        time.sleep(0.1)
    for pid, _ in live:
        if group_members(pid):
            _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    left: list[int] = []
    while time.monotonic() < deadline:
        left = [m for pid, _ in live for m in group_members(pid)]
        if not left:
            break
        time.sleep(0.05)
    return left


def reap() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
