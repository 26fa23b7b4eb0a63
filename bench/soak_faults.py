"""Faults the soak bench injects into a running stack, on a schedule.

- broker, learner, controlplane, node: SIGKILL of the part's process group (``node`` is
  the second node); the stack's supervisor restarts it (the broker comes back empty).
- scrubber: the first node's PII scrubber child is stopped (SIGSTOP) for ``hang_s``,
  then continued: scrubbing times out, records are dropped and counted, serving goes on.
- corrupt: a candidate drafter whose weights do not match its manifest is registered in
  MLflow (as the learner registers one); it must be refused and never served.
- rollback: an operator rollback (one admin API call) of the champion when there is a
  previous one to go back to, else of a canary in flight, which gives way to the champion
  it was replacing (a first promotion has no previous champion). With neither yet, it waits
  for one (until ``rollback_by``, the run's time by which the fleet still has room to
  converge); recorded as skipped when none came.

Each fault is a record: what, when, and how long until the part was ready again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from adaflash.controlplane_client import ControlPlaneClient, ControlPlaneError, ControlPlaneUnreachable

FAULTS = ("corrupt", "broker", "learner", "controlplane", "node", "scrubber", "rollback")
PART_OF = {"broker": "broker", "learner": "learner", "controlplane": "controlplane", "node": "dataplane-2"}


@dataclass
class Fault:
    name: str
    t: float
    ok: bool = False  # injected
    detail: str = ""
    recovered_s: float | None = None  # the part ready again after this long


class Injector:
    def __init__(self, settings, now, admin_token: str, hang_s: float = 10.0, rollback_by: float = float("inf")):
        self.settings, self.now, self.hang_s, self.rollback_by = settings, now, hang_s, rollback_by
        self.admin = admin_token
        self.faults: list[Fault] = []
        self.corrupted: list[str] = []  # versions registered with corrupted weights
        self._threads: list[threading.Thread] = []

    def _state(self) -> dict:
        from adaflash.stack_state import live_status

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
            elif name == "corrupt":
                self._corrupt_candidate(f)
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
        t = threading.Thread(target=self._rollback_when_promoted, args=(f,), daemon=True)
        t.start()
        self._threads.append(t)

    def _rollback_when_promoted(self, f: Fault, poll_s: float = 1.0) -> None:
        """Roll back as soon as there is something to go back to: the champion when there is a
        previous one, else a canary in flight (it gives way to the champion it was replacing).
        ``f.t`` is when it happened."""
        ep = self._state().get("endpoints", {})
        with ControlPlaneClient(ep["controlplane_api"], self.admin) as cp:
            self._roll_back(f, cp, poll_s)

    def _roll_back(self, f: Fault, cp: ControlPlaneClient, poll_s: float) -> None:
        asked = f.t
        while True:
            try:
                versions = cp.list_versions()
            except ControlPlaneError:  # the control plane may be the part just killed
                versions = []
            champ = next((v.version for v in versions if "champion" in v.aliases), None)
            prev = next((v.version for v in versions if "previous" in v.aliases), None)
            canary = next((v.version for v in versions if v.state == "canary"), None)
            target = canary if canary is not None and champ is not None else (champ if prev is not None else None)
            if target is not None:
                f.t = self.now()
                try:
                    promo = cp.rollback(target, "soak: operator rollback")
                    waited = f" (waited {f.t - asked:.0f}s for a promotion)" if f.t - asked >= 1 else ""
                    back_to = champ if target == canary else prev
                    f.ok, f.detail = True, f"rollback of {target} to {back_to}: promotion {promo.id}{waited}"
                    return
                except ControlPlaneError as e:  # raced a rollout, or the control plane is down: again
                    f.detail = f"rollback of {target}: {e}"[:300]
            if self.now() + poll_s > self.rollback_by:
                f.detail = (f.detail or f"skipped: champion {champ}, nothing to roll back to") + \
                    f" (gave up at t={self.rollback_by:.0f}s)"
                return
            time.sleep(poll_s)

    def _corrupt_candidate(self, f: Fault) -> None:
        import hashlib
        import shutil
        import tempfile

        from adaflash.contracts import DRAFTER_ARTIFACT_DIR
        from adaflash.contracts.registry import TAG_MANIFEST_SHA256, TAG_STATE
        from dataplane.node import STARTER_DIR
        from dataplane.target_cache import ensure_target, target_identity
        from learner.publish import STATE_CANDIDATE, Publisher

        ep = self._state().get("endpoints", {})
        pub = Publisher(ep["mlflow_tracking_uri"], target_identity(ensure_target(self.settings)))
        exp = pub._experiment()
        pub._registered_model()
        with tempfile.TemporaryDirectory(prefix="soak-corrupt-") as tmp:
            bundle = Path(tmp) / DRAFTER_ARTIFACT_DIR
            # the drafter the nodes serve (for their target), so only the corruption can refuse it
            shutil.copytree(Path(self.settings.dataplane.drafter or STARTER_DIR), bundle)
            weights = bundle / "model.safetensors"
            data = bytearray(weights.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])  # the manifest's digest no longer fits
            weights.write_bytes(bytes(data))
            digest = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
            run = pub.client.create_run(exp, run_name="soak-corrupted", tags={"adaflash.kind": "candidate"})
            pub.client.log_artifacts(run.info.run_id, str(bundle), artifact_path=DRAFTER_ARTIFACT_DIR)
            pub.client.set_terminated(run.info.run_id)
        mv = pub.client.create_model_version(pub.model_name, source=f"{run.info.artifact_uri}/{DRAFTER_ARTIFACT_DIR}",
                                             run_id=run.info.run_id,
                                             tags={TAG_STATE: STATE_CANDIDATE, TAG_MANIFEST_SHA256: digest})
        self.corrupted.append(str(mv.version))
        f.ok, f.detail = True, f"registered version {mv.version} with corrupted weights"

    def corrupted_outcome(self) -> dict:
        """Where each corrupted version ended up, and whether any node ever said it served it."""
        ep = self._state().get("endpoints", {})
        out = {}
        with ControlPlaneClient(ep["controlplane_api"], self.admin, timeout_s=10) as cp:
            served = cp.audit(action="node.served_version", limit=500)
            for v in self.corrupted:
                try:
                    state = cp.get_version(v).state
                except ControlPlaneUnreachable:
                    raise
                except ControlPlaneError as e:
                    state = f"HTTP {e.status}"
                ever = [e.target for e in served if (e.after or {}).get("served_version") == v]
                out[v] = {"state": state, "served_by": ever}
        return out

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
