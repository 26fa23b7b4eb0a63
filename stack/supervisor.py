"""The supervisor of the embedded stack: every part on one machine as child processes.

``adaflash up`` runs a :class:`Supervisor` that starts, in dependency order, a Tansu
broker, an MLflow server (SQLite + local artifacts), the control plane, the dataplane
nodes and the learners, each with its log under ``$ADAFLASH_HOME/logs``. It probes each
until ready (broker: TCP + Kafka metadata; MLflow: /health; control plane: /healthz;
node: /readyz; learner: alive), restarts a crashed one with exponential backoff, and
keeps the state file (``adaflash.stack_state``) that ``adaflash status`` reads and
``adaflash down`` uses to stop everything.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adaflash.config import Settings
from adaflash.stack_state import pid_alive, proc_start_time, read_state, state_path, write_state
from stack.plan import plan_stack
from stack.procs import stop_groups
from stack.services import ALL_PARTS, NEEDS, STOP_WAVES, Service, StackError


@dataclass
class Proc:
    """Runtime record of one part, as written to the state file."""

    name: str
    state: str = "pending"  # pending|starting|ready|unhealthy|crashed|restarting|stopping|stopped|missing|external
    pid: int | None = None
    start_time: int | None = None
    port: int | None = None
    url: str | None = None
    log: str | None = None
    restarts: int = 0
    last_exit: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    detail: str = ""
    # not persisted in a useful way, but harmless
    streak: int = 0
    next_start: float | None = None
    unhealthy_since: float | None = None


class Supervisor:
    """Starts the planned services, keeps them running, stops them on request."""

    def __init__(self, settings: Settings, config: str | None = None, random_ports: bool | None = None,
                 parts: list[str] | None = None, on_change: Callable[[dict], None] | None = None):
        self.settings = settings
        self.home = Path(settings.home).resolve()
        self.logs = self.home / "logs"
        self.sc = settings.stack
        self.services, self.missing, self.endpoints = plan_stack(settings, config, random_ports, parts)
        self.procs: dict[str, Proc] = {}
        for s in self.services:
            self.procs[s.name] = Proc(s.name, port=s.port, url=s.url, log=str(self.logs / f"{s.name}.log"))
        self._popen: dict[str, subprocess.Popen] = {}
        self._log_fh: dict[str, Any] = {}
        self._stop = False
        self._last_probe: dict[str, float] = {}
        self.on_change = on_change
        self.started_at = time.time()
        self.phase = "starting"
        self.path = state_path(self.home)

    # -- state
    def snapshot(self) -> dict:
        procs = {}
        kinds = {s.kind for s in self.services}
        for svc in self.services:
            d = asdict(self.procs[svc.name])
            for k in ("streak", "next_start", "unhealthy_since"):
                d.pop(k)
            procs[svc.name] = d
        for p in ALL_PARTS:
            if p not in kinds:
                why = self.missing.get(p, "")
                procs[p] = {"name": p, "state": "external" if why.startswith("external") else "missing",
                            "detail": why}
        return {"version": 1, "phase": self.phase, "supervisor": {"pid": os.getpid(),
                "start_time": proc_start_time(os.getpid()), "log": str(self.logs / "supervisor.log")},
                "started_at": self.started_at, "updated_at": time.time(), "endpoints": self.endpoints,
                "processes": procs, "missing": self.missing}

    def _save(self) -> None:
        snap = self.snapshot()
        write_state(self.path, snap)
        if self.on_change:
            self.on_change(snap)

    @property
    def ready(self) -> bool:
        return all(p.state == "ready" for p in self.procs.values())

    # -- life cycle
    def prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        cleanup_stale(self.home)
        self._save()

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def run(self, tick_s: float = 0.25, until_ready: bool = False) -> int:
        """Supervise until asked to stop (SIGTERM / SIGINT / request_stop); then stop all."""
        self.prepare()
        try:
            while not self._stop:
                self.tick()
                if self.phase == "starting" and self.ready:
                    self.phase = "ready"
                    self._save()
                    if until_ready:
                        return 0
                time.sleep(tick_s)
        finally:
            if not until_ready or self._stop:
                self.stop_all()
        return 0

    def tick(self) -> None:
        now = time.monotonic()
        changed = False
        for svc in self.services:
            p = self.procs[svc.name]
            popen = self._popen.get(svc.name)
            if popen is not None and popen.poll() is not None:  # exited
                code = popen.returncode
                self._close_log(svc.name)
                self._popen.pop(svc.name, None)
                # its group may still hold children (MLflow workers): clear them before a restart
                stop_groups([(p.pid, None)], self.sc.stop_timeout_s)
                p.last_exit, p.pid, p.start_time = code, None, None
                p.streak += 1
                delay = min(self.sc.restart_backoff_max_s, self.sc.restart_backoff_s * 2 ** (p.streak - 1))
                p.state, p.next_start = "restarting", now + delay
                p.detail = f"exited with {code}; restart in {delay:.0f}s"
                changed = True
                continue
            if p.state in ("pending", "restarting"):
                due = p.next_start is None or now >= p.next_start
                deps = [d.name for d in self.services if d.kind in NEEDS[svc.kind]]
                deps_ok = all(self.procs[d].state in ("ready", "unhealthy") for d in deps)
                if due and deps_ok:
                    self._start(svc, p)
                    changed = True
                elif not deps_ok and p.state == "pending":
                    waiting = [d for d in deps if self.procs[d].state != "ready"]
                    detail = f"waiting for {', '.join(waiting)}"
                    if p.detail != detail:
                        p.detail, changed = detail, True
                continue
            if p.state == "starting":
                ok, why = svc.probe()
                if ok:
                    if svc.after_ready is not None:
                        try:
                            why = svc.after_ready()
                        except Exception as e:  # noqa: BLE001 - retried at the next tick
                            p.detail = f"ready, but setup failed: {type(e).__name__}: {e}"
                            changed = True
                            continue
                    p.state, p.ready_at, p.detail = "ready", time.time(), why
                    self._last_probe[svc.name] = now
                    changed = True
                elif p.started_at and time.time() - p.started_at > self.sc.ready_timeout_s:
                    self._kill(svc.name, f"not ready after {self.sc.ready_timeout_s:.0f}s")
                    changed = True
                elif why != p.detail:
                    p.detail, changed = f"starting ({why})", True
                continue
            if p.state in ("ready", "unhealthy"):
                if p.streak and p.ready_at and time.time() - p.ready_at > self.sc.stable_after_s:
                    p.streak = 0
                if now - self._last_probe.get(svc.name, 0) >= self.sc.probe_interval_s:
                    self._last_probe[svc.name] = now
                    ok, why = svc.probe()
                    if ok and p.state == "unhealthy":
                        p.state, p.unhealthy_since, p.detail = "ready", None, why
                        if svc.after_ready is not None:
                            with contextlib.suppress(Exception):
                                p.detail = svc.after_ready()
                        changed = True
                    elif not ok and p.state == "ready":
                        p.state, p.unhealthy_since, p.detail = "unhealthy", now, f"probe failed: {why}"
                        changed = True
                    elif not ok and p.unhealthy_since and now - p.unhealthy_since > max(60.0, 4 * self.sc.probe_interval_s):
                        self._kill(svc.name, f"unhealthy for {now - p.unhealthy_since:.0f}s")
                        changed = True
        if changed:
            self._save()

    def _start(self, svc: Service, p: Proc) -> None:
        if svc.before_start is not None:
            try:
                svc.before_start(svc)
            except Exception as e:  # noqa: BLE001 - retried after a backoff
                p.streak += 1
                delay = min(self.sc.restart_backoff_max_s, self.sc.restart_backoff_s * 2 ** (p.streak - 1))
                p.state, p.next_start = "restarting", time.monotonic() + delay
                p.detail = f"cannot start: {e}"
                return
        if p.state == "restarting":
            p.restarts += 1
        log_path = self.logs / f"{svc.name}.log"
        fh = open(log_path, "ab")  # noqa: SIM115 - closed when the process exits
        fh.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {svc.name}: {' '.join(svc.argv)}\n".encode())
        fh.flush()
        env = {**os.environ, **svc.env}
        try:
            popen = subprocess.Popen(svc.argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=os.getcwd(), start_new_session=True)
        except OSError as e:
            fh.close()
            p.state, p.detail = "crashed", f"cannot execute: {e}"
            p.next_start = time.monotonic() + self.sc.restart_backoff_max_s
            p.state = "restarting"
            return
        self._popen[svc.name] = popen
        self._log_fh[svc.name] = fh
        p.pid, p.start_time = popen.pid, proc_start_time(popen.pid)
        p.state, p.started_at, p.ready_at, p.detail, p.next_start = "starting", time.time(), None, "starting", None

    def _kill(self, name: str, why: str) -> None:
        p = self.procs[name]
        if p.pid:
            stop_groups([(p.pid, p.start_time)], self.sc.stop_timeout_s)
        p.detail = why  # the exit is noticed (and the restart scheduled) at the next tick

    def _close_log(self, name: str) -> None:
        fh = self._log_fh.pop(name, None)
        if fh is not None:
            fh.close()

    def stop_all(self) -> list[int]:
        self.phase = "stopping"
        for p in self.procs.values():
            if p.pid:
                p.state = "stopping"
        self._save()
        left: list[int] = []
        for kinds in STOP_WAVES:
            wave = [svc.name for svc in self.services if svc.kind in kinds]
            groups = [(self.procs[n].pid, self.procs[n].start_time) for n in wave
                      if n in self.procs and self.procs[n].pid]
            if groups:
                left += stop_groups(groups, self.sc.stop_timeout_s)
            for n in wave:
                if n in self.procs:
                    pop = self._popen.pop(n, None)
                    if pop is not None:
                        with contextlib.suppress(Exception):
                            pop.wait(timeout=1)
                        self.procs[n].last_exit = pop.returncode
                    self._close_log(n)
                    self.procs[n].state, self.procs[n].pid, self.procs[n].start_time = "stopped", None, None
                    self.procs[n].detail = ""
        self.phase = "stopped" if not left else "stopped-with-leftovers"
        self._save()
        return left


def cleanup_stale(home: Path) -> list[int]:
    """Kill children a previous supervisor left behind (it was killed itself)."""
    state = read_state(home)
    if not state:
        return []
    sup = state.get("supervisor") or {}
    if sup.get("pid") and sup.get("pid") != os.getpid() and pid_alive(sup.get("pid"), sup.get("start_time")):
        raise StackError(f"a stack is already running under {home} (supervisor pid {sup['pid']}); "
                         "see `adaflash status`, stop it with `adaflash down`")
    groups = [(p["pid"], p.get("start_time")) for p in state.get("processes", {}).values()
              if p.get("pid") and pid_alive(p["pid"], p.get("start_time"))]
    return stop_groups(groups, 5.0) if groups else []
