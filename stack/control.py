"""``adaflash down`` and the detached ``adaflash up``: commands on a running stack."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from adaflash.config import Settings
from adaflash.stack_state import pid_alive, read_state, state_path, write_state
from stack import parts as stack_parts
from stack.procs import reap, stop_groups
from stack.services import STOP_WAVES, StackError, cli_argv


def down(settings: Settings, timeout_s: float | None = None) -> dict:
    """Stop the stack: ask the supervisor (SIGTERM), then make sure by pid that every
    process it ran is gone. Returns {stopped: [...], leftover: [...]}."""
    home = Path(settings.home).resolve()
    state = read_state(home)
    if state is None:
        return {"stopped": [], "leftover": [], "message": f"no stack state under {home}"}
    timeout_s = timeout_s if timeout_s is not None else settings.stack.stop_timeout_s * len(STOP_WAVES) + 15
    sup = state.get("supervisor") or {}
    pids = {n: (p.get("pid"), p.get("start_time")) for n, p in state.get("processes", {}).items() if p.get("pid")}
    if pid_alive(sup.get("pid"), sup.get("start_time")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(sup["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pid_alive(sup.get("pid"), sup.get("start_time")):
            reap()
            time.sleep(0.1)
        if pid_alive(sup.get("pid"), sup.get("start_time")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(sup["pid"], signal.SIGKILL)
    # whatever the supervisor did, make sure by pid and process group
    left = stop_groups([v for v in pids.values()], settings.stack.stop_timeout_s)
    state = read_state(home) or state
    for p in state.get("processes", {}).values():
        if p.get("pid") and not pid_alive(p["pid"], p.get("start_time")):
            p["state"], p["pid"], p["start_time"] = "stopped", None, None
    state["phase"] = "stopped" if not left else "stopped-with-leftovers"
    state["updated_at"] = time.time()
    ep = state.get("endpoints") or {}
    if ep.get("postgres_database") and not left:  # this run's own database (stack.database: postgres)
        try:
            stack_parts.drop_database(ep["postgres_admin_dsn"], ep["postgres_database"])
            ep["postgres_database"] = None
        except Exception as e:  # noqa: BLE001 - reported; the database can be dropped by hand
            state["database_drop_error"] = f"{type(e).__name__}: {e}"
    write_state(state_path(home), state)
    return {"stopped": sorted(pids), "leftover": left,
            "message": "stopped" if not left else f"processes still alive: {left}"}


def wait_ready(settings: Settings, supervisor_pid: int, timeout_s: float,
               on_change: Callable[[dict], None] | None = None) -> dict:
    """Poll the state file until the stack is ready, the supervisor died, or time ran out."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        reap()
        state = read_state(settings)
        if state and (state.get("supervisor") or {}).get("pid") == supervisor_pid:
            if on_change and state.get("updated_at") != last:
                last = state.get("updated_at")
                on_change(state)
            if state.get("phase") == "ready":
                return state
            if state.get("phase") in ("stopping", "stopped"):
                raise StackError("the stack stopped while starting; see the logs under "
                                 f"{state['endpoints'].get('logs_dir')}")
        if not pid_alive(supervisor_pid):
            raise StackError("the supervisor exited while starting; see "
                             f"{Path(settings.home).resolve() / 'logs' / 'supervisor.log'}")
        time.sleep(0.3)
    raise StackError(f"the stack was not ready after {timeout_s:.0f}s; `adaflash status` shows which part "
                     "is not")


def spawn_detached(settings: Settings, config: str | None, extra: list[str]) -> int:
    """Start ``adaflash up --supervise`` in its own session; returns its pid."""
    home = Path(settings.home).resolve()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    log = open(home / "logs" / "supervisor.log", "ab")  # noqa: SIM115 - handed to the child
    env = {**os.environ, "ADAFLASH_HOME": str(home)}
    try:
        popen = subprocess.Popen(cli_argv(config, "up", "--supervise", *extra), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, cwd=os.getcwd(), start_new_session=True)
    finally:
        log.close()
    return popen.pid
