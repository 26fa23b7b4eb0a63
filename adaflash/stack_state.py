"""The embedded stack's state file: what ``adaflash up`` writes and every reader trusts.

``$ADAFLASH_HOME/stack.json`` holds the supervisor's pid and start time, each process's
pid, start time, port, URL and state, and the stack's endpoints. The supervisor
(``stack/``) writes it; ``adaflash status``, the demo and the control-plane client read
it through :func:`live_status`, which corrects it by what is alive now (a pid is only
trusted together with its start time, so a reused pid never passes for a live part).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from adaflash.config import Settings

STATE_FILE = "stack.json"


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (from /proc), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    fields = raw[raw.rfind(")") + 2:].split()
    try:
        if fields[0] == "Z":  # a zombie is gone for our purposes
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int | None, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs and (when given) is still the process started at ``start_time``."""
    if not pid:
        return False
    st = proc_start_time(pid)
    if st is None:
        return False
    return start_time is None or st == start_time


def state_path(settings_or_home: Settings | Path | str) -> Path:
    home = settings_or_home.home if isinstance(settings_or_home, Settings) else settings_or_home
    return Path(home).resolve() / STATE_FILE


def read_state(settings_or_home: Settings | Path | str) -> dict | None:
    p = state_path(settings_or_home)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def write_state(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=False))
    os.replace(tmp, path)


def live_status(settings: Settings) -> dict:
    """The state file, corrected by what is actually alive now."""
    state = read_state(settings)
    home = str(Path(settings.home).resolve())
    if state is None:
        return {"running": False, "phase": "absent", "endpoints": {"state_dir": home}, "processes": {},
                "missing": {}}
    sup = state.get("supervisor") or {}
    running = pid_alive(sup.get("pid"), sup.get("start_time"))
    state["running"] = running
    for p in state.get("processes", {}).values():
        pid = p.get("pid")
        p["alive"] = bool(pid) and pid_alive(pid, p.get("start_time"))
        if pid and not p["alive"] and p.get("state") not in ("stopped", "restarting"):
            p["state"] = "dead"
    if not running and state.get("phase") not in ("stopped",):
        state["phase"] = "supervisor-gone" if any(p.get("alive") for p in state["processes"].values()) \
            else "stopped"
    return state
