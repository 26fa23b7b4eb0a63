"""``adaflash demo``: one narrow domain's traffic through a running stack, adaptation shown live.

The tenants' traffic is ``web-desk`` (promptsets/narrow.py): real front-end questions that
neither the offline drafter data nor the adaptation benchmark uses.

1. Before: a fixed measurement set (the domain's held-out prompts) is served under a
   tenant whose feedback is opted out, so the learner never trains on what is measured;
   tau (mean accepted tokens per verify round) and tokens/s are recorded. Learning and
   shadow evaluation are held (controlplane/hold.py) while it runs, so the measurement
   has the machine to itself.
2. Adapt: two tenants send the domain's stream (training split); their feedback flows to
   the learner. The terminal shows tau / TPS over the last requests, candidates as they
   appear in the control plane, their evaluation, gate decision, approval and promotion,
   until the node serves a new champion.
3. After: the same measurement set again, under the hold again. A before/after table is
   printed and written, with a PNG, under $ADAFLASH_HOME/demo (or --out).

Candidates awaiting approval are approved through the admin API unless
--no-auto-approve (the embedded stack's demo policy approves by itself).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from pathlib import Path

import httpx

from adaflash.controlplane_client import ControlPlaneClient, ControlPlaneError
from adaflash.credentials import read_file
from adaflash.stack_state import live_status
from demo.traffic import (
    DOMAIN,
    EVAL_TENANT,
    TENANTS,
    Client,
    Result,
    prompts_by_domain,
    run_batch,
    tau_of,
    tps_of,
)
from stack.services import StackError


class Demo:
    def __init__(self, args, settings):
        self.args = args
        self.settings = settings
        st = live_status(settings)
        if not st.get("running"):
            raise StackError(f"no running stack under {settings.home}: start one with `adaflash up --detach`")
        ep = st["endpoints"]
        if not ep.get("dataplane_url") or not ep.get("controlplane_api"):
            raise StackError("the demo needs a dataplane node and the control plane in the stack")
        self.ep = ep
        token = read_file(ep["admin_token_file"]) or ""
        self.admin_token = token
        self.cp = ControlPlaneClient(ep["controlplane_url"], token, timeout_s=15)
        self.client = Client(ep["dataplane_url"], args.max_tokens)
        self.out = Path(args.out) if args.out else Path(settings.home) / "demo"
        self.missing = {k: v for k, v in (st.get("missing") or {}).items()}
        self.results: list[Result] = []
        self.events: deque[str] = deque(maxlen=12)
        self.versions: dict[str, dict] = {}
        self.node: dict = {}
        self.phase = "setup"
        self.baseline_version: str | None = None
        self.promoted: str | None = None
        self.figures: dict | None = None  # the promoted version's predicted / realised figures
        self.node_drafter: dict = {}
        self.log: list[str] = []  # every event (the live view shows the last ones)
        self.plain = False  # not a terminal: events as plain lines instead of a live view
        self.started = time.monotonic()
        self.promoted_evt = threading.Event()  # set by the poller: stop the traffic batch early
        self.holds: list[dict] = []  # each measurement's learning hold: taken, taken effect, after how long

    # -- live view
    def event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')}  {text}"
        self.events.append(line)
        self.log.append(line)
        if self.plain:
            print(line, flush=True)

    def view(self):
        from rich.console import Group
        from rich.table import Table

        t = Table(title=f"traffic ({self.phase})", title_justify="left")
        for c in ("domain", "requests", "tau (last 20)", "tok/s (last 20)", "drafter"):
            t.add_column(c)
        for d in ("chat", "code", "math"):
            rs = [r for r in self.results if r.domain == d and r.ok]
            last = rs[-20:]
            t.add_row(d, str(len(rs)), f"{tau_of(last):.2f}", f"{tps_of(last):.1f}",
                      (last[-1].version or "") if last else "")
        v = Table(title="registry versions", title_justify="left")
        for c in ("version", "state", "reason"):
            v.add_column(c)
        for ver, row in sorted(self.versions.items(), key=lambda kv: _num(kv[0]))[-8:]:
            v.add_row(ver, row.get("state", ""), (row.get("state_reason") or "")[:60])
        n = self.node
        node = (f"node {n.get('node_id', '?')}: serves {n.get('served_version')} (desired {n.get('desired_version')}),"
                f" live tau {n.get('live_tau') or 0:.2f}, {n.get('live_tps') or 0:.1f} tok/s") if n else "node: -"
        return Group(t, v, node, "\n".join(self.events) or "(no events yet)")

    # -- control plane polling
    def poll(self) -> None:
        try:
            versions = [v.model_dump(mode="json") for v in self.cp.list_versions(limit=50)]
            nodes = [n.model_dump(mode="json") for n in self.cp.list_nodes()]
        except ControlPlaneError as e:
            self.event(f"control plane unreachable: {type(e).__name__}")
            return
        for row in versions:
            ver, state = row["version"], row["state"]
            old = self.versions.get(ver, {}).get("state")
            if old != state:
                if old is None:
                    self.event(f"candidate {ver} appeared ({state})")
                else:
                    self.event(f"version {ver}: {old} -> {state}" + (f" ({row.get('state_reason')})"
                                                                      if row.get("state_reason") else ""))
                if state in ("gate_failed", "awaiting_approval", "approved"):
                    self._gates(ver)
            self.versions[ver] = row
        if nodes:
            n = next((x for x in nodes if x["node_id"] == self.settings.stack.node_id), nodes[0])
            if self.node and n.get("served_version") != self.node.get("served_version"):
                self.event(f"node {n['node_id']} now serves {n.get('served_version')}")
            self.node = n
        for ver, row in self.versions.items():
            if row["state"] == "awaiting_approval" and not self.args.no_auto_approve and not row.get("_asked"):
                row["_asked"] = True
                try:
                    self.cp.approve(ver, "adaflash demo: automatic approval")
                    self.event(f"version {ver} approved by the demo")
                except ControlPlaneError as e:
                    self.event(f"approving {ver} failed: {e}")

    def _gates(self, ver: str) -> None:
        try:
            detail = self.cp.get_version(ver).model_dump(mode="json")
        except ControlPlaneError:
            return
        gates = detail.get("gate_results") or []
        if gates:
            failed = [g["name"] for g in gates if not g["passed"]]
            self.event(f"gates for {ver}: " + ("all passed" if not failed else f"failed {', '.join(failed)}")
                       + f" (policy {gates[0]['policy_version']})")
        for a in detail.get("approvals") or []:
            self.event(f"{ver}: {a['decision']} by {a['actor']}")

    # -- phases
    def measure(self, prompts: dict[str, list[str]], phase: str) -> list[Result]:
        jobs = [(p, d, EVAL_TENANT) for d, ps in prompts.items() for p in ps]
        with self.learning_held(phase):
            return run_batch(self.client, jobs, self.args.concurrency, self.results)

    @contextlib.contextmanager
    def learning_held(self, phase: str):
        """Hold learning and shadow evaluation (controlplane/hold.py) while a measurement runs, so
        it has the machine to itself; waits until the hold has taken effect (a learner step or
        an evaluation under way finishes first) and restores the hold found before."""
        t0 = time.monotonic()
        note = {"phase": phase, "held": False, "quiet": False, "waited_s": 0.0}
        self.holds.append(note)
        try:
            was = self.cp.get_hold()
            h = self.cp.set_hold(True, True, f"adaflash demo: measuring {phase}")
        except ControlPlaneError as e:
            note["error"] = e.message
            self.event(f"[yellow]could not hold learning for the {phase} measurement ({e.message}); "
                       "measuring beside it[/yellow]")
            yield
            return
        note["held"] = True
        self.event(f"learning and shadow evaluation held for the {phase} measurement; waiting until they pause")
        deadline = t0 + self.args.quiet_timeout
        while not h.quiet and time.monotonic() < deadline:
            time.sleep(2.0)
            with contextlib.suppress(ControlPlaneError, httpx.HTTPError):
                h = self.cp.get_hold()
        note["quiet"], note["waited_s"] = h.quiet, round(time.monotonic() - t0, 1)
        if not h.quiet:
            self.event(f"[yellow]learners or an evaluation still busy after {self.args.quiet_timeout:.0f}s "
                       f"(evaluating: {', '.join(h.evaluating) or '-'}); measuring anyway[/yellow]")
        try:
            yield
        finally:
            with contextlib.suppress(ControlPlaneError, httpx.HTTPError):
                self.cp.set_hold(was.learning, was.evaluation, was.reason or f"adaflash demo: {phase} measured")

    def run(self) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        self.plain = not console.is_terminal
        n_eval = self.args.requests or 24
        ev, traffic, source = prompts_by_domain(n_eval, 200)
        console.print(f"prompts: {source}; measurement set {sum(map(len, ev.values()))} requests "
                      f"(tenant {EVAL_TENANT}, feedback opted out)")
        for name, why in self.missing.items():
            if not why.startswith("external"):
                console.print(f"[yellow]stack part {name} is missing ({why}): "
                              f"{'no candidate can appear' if name == 'learner' else 'the loop is incomplete'}"
                              "[/yellow]")
        self.set_policies(console)
        self.out.mkdir(parents=True, exist_ok=True)
        stop = threading.Event()
        live_cm = _NoLive() if self.plain else Live(self.view(), console=console, refresh_per_second=2)
        with live_cm as live:
            poller = threading.Thread(target=self._poll_loop, args=(stop, live), daemon=True)
            poller.start()
            self.phase = "before: measuring"
            self.event(f"measuring the baseline: {sum(map(len, ev.values()))} requests")
            before = self.measure(ev, "before")
            self.baseline_version = _mode([r.version for r in before if r.ok])
            self.event(f"baseline measured on drafter {self.baseline_version}; tau {tau_of(before):.2f}")
            self.phase = "adapting: tenant traffic"
            deadline = time.monotonic() + self.args.timeout
            self.event(f"tenant traffic until a new champion serves (deadline {self.args.timeout:.0f}s)")
            cursor, last_note = 0, time.monotonic()
            while time.monotonic() < deadline and not self._promoted():
                self.promoted_evt.clear()
                jobs = []
                for tenant, d in TENANTS.items():
                    ps = traffic[d]
                    for i in range(self.args.concurrency):
                        jobs.append((ps[(cursor + i) % len(ps)], d, tenant))
                cursor += self.args.concurrency
                run_batch(self.client, jobs, self.args.concurrency, self.results, stop=self.promoted_evt)
                if self.plain and time.monotonic() - last_note > 60:
                    last_note = time.monotonic()
                    self.event(self.progress_line())
            after: list[Result] = []
            if self.promoted:
                self.node_drafter = self.node_admin_drafter()
                self.event(f"{self.promoted} is champion; the node's /admin/drafter reports "
                           f"{self.node_drafter.get('version')} after {_dur(time.monotonic() - self.started)}")
                self.phase = f"after: measuring on {self.promoted}"
                after = self.measure(ev, "after")
                self.figures = self.promoted_figures()
            else:
                self.event(f"deadline of {self.args.timeout:.0f}s passed without a promotion")
            stop.set()
            poller.join(timeout=5)
            self.poll()
            live.update(self.view())
        console.print()
        return self.report(console, before, after, ev)

    def set_policies(self, console) -> None:
        """Opt the measurement tenant out and sample every traffic tenant; wait until the
        node's cached tenant policies expire, so no measurement request becomes feedback."""
        changed = False
        for tenant, want in [(EVAL_TENANT, {"opt_out": True})] + [(t, {"sampling_rate": 1.0}) for t in TENANTS]:
            try:
                have = self.cp.get_tenant_policy(tenant).model_dump(mode="json")
            except ControlPlaneError:
                have = {}
            if tenant != EVAL_TENANT and have.get("opt_out"):
                console.print(f"[yellow]tenant {tenant} is opted out: its traffic gives no feedback (left as is)"
                              "[/yellow]")
                continue
            if any(have.get(k) != v for k, v in want.items()):
                self.cp.set_tenant_policy(tenant, **want)
                changed = True
        if changed and self.settings.governance.feedback_enabled:
            wait = self.settings.governance.policy_ttl_s + 2.0
            console.print(f"tenant policies set; waiting {wait:.0f}s for the node to pick them up "
                          "(governance.policy_ttl_s)")
            time.sleep(wait)

    def promoted_figures(self, wait_s: float = 30.0) -> dict | None:
        """The promoted version's shadow-predicted and realised (live, from the nodes' heartbeats)
        figures as the control plane's version page shows them; waits up to ``wait_s`` for the
        heartbeats that followed the after-measurement."""
        deadline = time.monotonic() + wait_s
        fig = None
        while True:
            with contextlib.suppress(ControlPlaneError, httpx.HTTPError):  # asked again until the deadline
                fig = self.cp.get_version(self.promoted).figures.model_dump(mode="json")
            if (fig and fig.get("realised_samples")) or time.monotonic() > deadline:
                return fig
            time.sleep(2.0)

    def node_admin_drafter(self) -> dict:
        """The node's own view of what it serves (GET /admin/drafter, admin key)."""
        try:
            r = httpx.get(f"{self.ep['dataplane_url']}/admin/drafter", timeout=15,
                          headers={"Authorization": f"Bearer {self.admin_token}"})
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def progress_line(self) -> str:
        rs = [r for r in self.results if r.ok and r.tenant != EVAL_TENANT]
        states = {}
        for row in self.versions.values():
            states[row["state"]] = states.get(row["state"], 0) + 1
        return (f"{_dur(time.monotonic() - self.started)}: {len(rs)} tenant requests, tau (last 30) "
                f"{tau_of(rs[-30:]):.2f}; versions {states or 'none yet'}; node serves "
                f"{self.node.get('served_version')}")

    def _promoted(self) -> bool:
        n = self.node
        served = n.get("served_version")
        champ = [v for v, row in self.versions.items() if row["state"] == "champion"]
        if served and served != self.baseline_version and served in champ:
            self.promoted = served
            return True
        return False

    def _poll_loop(self, stop: threading.Event, live) -> None:
        while not stop.is_set():
            self.poll()
            if self.baseline_version and self._promoted():
                self.promoted_evt.set()
            live.update(self.view())
            stop.wait(2.0)

    # -- report
    def report(self, console, before: list[Result], after: list[Result], ev: dict[str, list[str]]) -> int:
        from rich.table import Table

        rows = []
        for d in ev:
            b = [r for r in before if r.domain == d and r.ok]
            a = [r for r in after if r.domain == d and r.ok]
            rows.append({"domain": d, "n": len(b), "tau_before": tau_of(b), "tau_after": tau_of(a) if a else None,
                         "tps_before": tps_of(b), "tps_after": tps_of(a) if a else None})
        allb = [r for r in before if r.ok]
        alla = [r for r in after if r.ok]
        rows.append({"domain": "all", "n": len(allb), "tau_before": tau_of(allb),
                     "tau_after": tau_of(alla) if alla else None, "tps_before": tps_of(allb),
                     "tps_after": tps_of(alla) if alla else None})
        t = Table(title=f"before ({self.baseline_version}) / after ({self.promoted or 'no promotion'})",
                  title_justify="left")
        for c in ("domain", "requests", "tau before", "tau after", "tok/s before", "tok/s after"):
            t.add_column(c)
        for r in rows:
            t.add_row(r["domain"], str(r["n"]), f"{r['tau_before']:.2f}", _f(r["tau_after"]),
                      f"{r['tps_before']:.1f}", _f(r["tps_after"], 1))
        console.print(t)
        console.print(f"tau: committed tokens per verify round (1.00 = every round verified one token). tok/s: "
                      f"mean per request at concurrency {self.args.concurrency}. " + _hold_line(self.holds))
        hist = Table(title="candidates", title_justify="left")
        for c in ("version", "state", "reason"):
            hist.add_column(c)
        for ver, row in sorted(self.versions.items(), key=lambda kv: _num(kv[0])):
            hist.add_row(ver, row.get("state", ""), (row.get("state_reason") or "")[:90])
        if self.versions:
            console.print(hist)
        elapsed = time.monotonic() - self.started
        after_versions = sorted({r.version for r in after if r.ok and r.version})
        if self.promoted:
            console.print(f"promotion: {self.baseline_version} -> {self.promoted} (node /admin/drafter: "
                          f"{self.node_drafter.get('version')}; after-measurement served by "
                          f"{', '.join(after_versions) or '-'}); demo took {_dur(elapsed)}")
        fig = self.figures or {}
        if fig.get("tau_ratio") is not None:
            console.print(f"{self.promoted}: shadow-predicted tau {fig['predicted_tau']:.3f}, live tau the nodes "
                          f"reported {fig['realised_tau']:.3f} over {fig['realised_samples']} heartbeats "
                          f"(ratio {fig['tau_ratio']:.3f}; GET /api/v1/versions/{self.promoted} shows both)")
        summary = {"baseline_version": self.baseline_version, "promoted_version": self.promoted,
                   "predicted_realised": fig or None, "domain": DOMAIN, "tenants": sorted(TENANTS),
                   "measurement_holds": self.holds,
                   "node_admin_drafter": self.node_drafter, "after_served_by": after_versions,
                   "elapsed_s": round(elapsed, 1), "rows": rows,
                   "versions": {v: {k: x for k, x in row.items() if not k.startswith("_")}
                                for v, row in self.versions.items()},
                   "events": self.log, "requests": len(self.results),
                   "errors": sum(1 for r in self.results if not r.ok)}
        (self.out / "demo.json").write_text(json.dumps(summary, indent=2, default=str))
        png = self.out / "demo.png"
        plot(rows, png, self.baseline_version, self.promoted)
        console.print(f"wrote {png} and {self.out / 'demo.json'}")
        if not self.promoted:
            states = sorted({row.get("state", "") for row in self.versions.values()})
            console.print(f"[yellow]no promotion within the deadline ({self.args.timeout:.0f}s, --timeout): "
                          f"{len(self.versions)} candidate(s) appeared (states: {', '.join(states) or 'none'}); "
                          "the table shows the baseline only. See the candidates above, the learner log under "
                          "$ADAFLASH_HOME/logs and `adaflash status`.[/yellow]")
            return 1
        return 0


def plot(rows: list[dict], path: Path, before: str | None, after: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doms = [r["domain"] for r in rows]
    x = range(len(doms))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tau", "tau (accepted tokens per round)"), (axes[1], "tps", "tokens/s")):
        b = [r[f"{key}_before"] for r in rows]
        a = [r[f"{key}_after"] or 0.0 for r in rows]
        ax.bar([i - 0.2 for i in x], b, 0.4, label=f"before ({before})")
        ax.bar([i + 0.2 for i in x], a, 0.4, label=f"after ({after or 'none'})")
        ax.set_xticks(list(x), doms)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("AdaFlash demo: held-out measurement set before and after promotion")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class _NoLive:
    """Stands in for rich's Live when the output is not a terminal (events print as lines)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, *_) -> None:
        return None


def _hold_line(holds: list[dict]) -> str:
    """How the measurements were protected from the learner and shadow evaluation."""
    if holds and all(h["held"] and h["quiet"] for h in holds):
        waits = ", ".join(f"{h['waited_s']:.0f}s" for h in holds)
        return ("Every measurement ran under a learning hold: learners and shadow evaluation paused "
                f"(waited {waits} for them to pause).")
    return ("Some measurement ran beside the learner or shadow evaluation: "
            + "; ".join(f"{h['phase']}: {'held' if h['held'] else 'not held'}, {'paused' if h['quiet'] else 'busy'}"
                        for h in holds) + ".")


def _dur(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 60}m{s % 60:02d}s"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _mode(xs: list) -> str | None:
    xs = [x for x in xs if x]
    return max(set(xs), key=xs.count) if xs else None


def _num(v: str):
    return (0, int(v)) if v.isdigit() else (1, v)


def run_demo(args, settings) -> int:
    from adaflash.cli import CliError

    try:
        return Demo(args, settings).run()
    except (StackError, ControlPlaneError, httpx.HTTPError) as e:
        raise CliError(str(e)) from e
