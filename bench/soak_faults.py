"""Faults the soak bench injects into a running stack, on a schedule.

- broker, learner, controlplane, node: SIGKILL of the part's process group (``node`` is
  the second node); the stack's supervisor restarts it (the broker comes back empty).
- scrubber: the first node's PII scrubber child is stopped (SIGSTOP) for ``hang_s``,
  then continued: scrubbing times out, records are dropped and counted, serving goes on.
- rollback: an operator rollback of the champion (one admin API call), when there is a
  previous champion to go back to; recorded as skipped otherwise.

Each fault is a record: what, when, and how long until the part was ready again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

FAULTS = ("broker", "learner", "controlplane", "node", "scrubber", "rollback")
PART_OF = {"broker": "broker", "learner": "learner", "controlplane": "controlplane", "node": "dataplane-2"}


@dataclass
class Fault:
    name: str
    t: float
    ok: bool = False  # injected
    detail: str = ""
    recovered_s: float | None = None  # the part ready again after this long


class Injector:
    def __init__(self, settings, now, admin_token: str, hang_s: float = 10.0):
        self.settings, self.now, self.hang_s = settings, now, hang_s
        self.admin = admin_token
        self.faults: list[Fault] = []
        self._threads: list[threading.Thread] = []

    def _state(self) -> dict:
        from adaflash.stack import live_status

        return live_status(self.settings)

    def inject(self, name: str) -> Fault:
        f = Fault(name, self.now())
        try:
            if name in PART_OF:
                self._kill(f, PART_OF[name])
            elif name == "scrubber":
                self._hang_scrubber(f)
            elif name == "rollback":
                self._rollback(f)
            else:
                f.detail = f"unknown fault {name!r}"
        except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported
            f.detail = f"{type(e).__name__}: {e}"
        self.faults.append(f)
        return f

    def _kill(self, f: Fault, part: str) -> None:
        procs = self._state().get("processes", {})
        p = procs.get(part) or {}
        if not p.get("pid"):
            f.detail = f"{part} has no process"
            return
        before = p.get("restarts", 0)
        os.killpg(p["pid"], signal.SIGKILL)
        f.ok, f.detail = True, f"SIGKILL {part} pid {p['pid']}"
        t = threading.Thread(target=self._await_ready, args=(f, part, before), daemon=True)
        t.start()
        self._threads.append(t)

    def _await_ready(self, f: Fault, part: str, restarts_before: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = self._state().get("processes", {}).get(part) or {}
            if p.get("restarts", 0) > restarts_before and p.get("state") == "ready":
                f.recovered_s = self.now() - f.t
                return
            time.sleep(0.5)

    def _hang_scrubber(self, f: Fault) -> None:
        node = self._state().get("processes", {}).get("dataplane") or {}
        kids = _children(node.get("pid"))
        scrub = [pid for pid in kids if b"spawn_main" in _cmdline(pid)]
        if not scrub:
            f.detail = "no scrubber process found (feedback off?)"
            return
        for pid in scrub:
            os.kill(pid, signal.SIGSTOP)
        f.ok, f.detail = True, f"SIGSTOP scrubber pid {scrub} for {self.hang_s:g}s"

        def resume():
            time.sleep(self.hang_s)
            for pid in scrub:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            f.recovered_s = self.now() - f.t

        t = threading.Thread(target=resume, daemon=True)
        t.start()
        self._threads.append(t)

    def _rollback(self, f: Fault) -> None:
        ep = self._state().get("endpoints", {})
        api, hdr = ep["controlplane_api"], {"Authorization": f"Bearer {self.admin}"}
        versions = httpx.get(f"{api}/versions", headers=hdr, timeout=10).json()
        champ = next((v["version"] for v in versions if "champion" in (v.get("aliases") or [])), None)
        prev = next((v["version"] for v in versions if "previous" in (v.get("aliases") or [])), None)
        if champ is None or prev is None:
            f.detail = f"skipped: champion {champ}, no previous champion to roll back to"
            return
        r = httpx.post(f"{api}/versions/{champ}/rollback", headers=hdr, json={"reason": "soak: operator rollback"},
                       timeout=30)
        f.ok, f.detail = r.status_code < 300, f"rollback of {champ}: HTTP {r.status_code}"

    def wait(self, timeout_s: float = 120.0) -> None:
        for t in self._threads:
            t.join(timeout=timeout_s)

    def records(self) -> list[dict]:
        return [asdict(f) for f in self.faults]


def _children(pid: int | None) -> list[int]:
    if not pid:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
