"""``adaflash up`` / ``down`` / ``status``: the embedded stack on one machine."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

STATE_STYLE = {"ready": "green", "starting": "yellow", "pending": "dim", "restarting": "magenta",
               "unhealthy": "red", "dead": "red", "crashed": "red", "stopping": "yellow", "stopped": "dim",
               "missing": "dim", "external": "cyan"}


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start the whole stack on this machine (broker, MLflow, control plane, node, "
                                   "learner)",
                        description="Start the embedded stack as supervised processes (logs and state under "
                                    "$ADAFLASH_HOME). Runs in the foreground with a live status table until "
                                    "Ctrl-C; --detach returns once every part is ready.")
    up.add_argument("--detach", "-d", action="store_true", help="run in the background; return once ready")
    up.add_argument("--random-ports", action="store_true", default=None,
                    help="random free ports instead of the configured ones")
    up.add_argument("--only", default=None, metavar="PARTS",
                    help="comma-separated parts to run (broker,mlflow,controlplane,dataplane,learner)")
    up.add_argument("--without", default=None, metavar="PARTS", help="comma-separated parts to leave out")
    up.add_argument("--nodes", type=int, default=None, help="serving nodes (default stack.nodes, 1)")
    up.add_argument("--learners", type=int, default=None,
                    help="learners in one consumer group (default stack.learners, 1)")
    up.add_argument("--database", choices=["sqlite", "postgres"], default=None,
                    help="control-plane database: sqlite (default) or a fresh PostgreSQL database for this run")
    up.add_argument("--timeout", type=float, default=None, help="--detach: seconds to wait for ready "
                                                                "(default stack.ready_timeout_s)")
    up.add_argument("--json", action="store_true", help="--detach: print the status as JSON once ready")
    up.add_argument("--supervise", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the stack started by `adaflash up`; leaves no process behind")
    down.add_argument("--timeout", type=float, default=None, help="seconds to wait for a clean stop")
    down.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="state of the stack: processes, endpoints, restarts")
    st.add_argument("--json", action="store_true", help="machine-readable: every endpoint and process")
    st.set_defaults(func=cmd_status)


def _parts(args, settings) -> list[str] | None:
    from stack.services import ALL_PARTS, StackError

    parts = list(settings.stack.parts)
    if args.only:
        parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if args.without:
        drop = {p.strip() for p in args.without.split(",") if p.strip()}
        parts = [p for p in parts if p not in drop]
    bad = [p for p in parts if p not in ALL_PARTS]
    if bad:
        raise StackError(f"unknown part(s) {', '.join(bad)}; known: {', '.join(ALL_PARTS)}")
    return parts


def _wrap(fn):
    def run(args, settings):
        from adaflash.cli import CliError
        from stack.services import StackError

        try:
            return fn(args, settings)
        except StackError as e:
            raise CliError(str(e)) from e

    return run


# --------------------------------------------------------------------------- rendering


def render_table(state: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time()
    t = Table(title=f"AdaFlash stack: {state.get('phase', '?')}", title_justify="left", expand=False)
    # the detail column gives way first; the others keep their width on narrow terminals
    widths = {"part": 12, "state": 10, "pid": 7, "endpoint": 21, "restarts": 8, "up": 6, "detail": 8}
    for col in ("part", "state", "pid", "endpoint", "restarts", "up", "detail"):
        t.add_column(col, no_wrap=True, overflow="ellipsis", min_width=widths[col])
    for name, p in (state.get("processes") or {}).items():
        st = p.get("state", "?")
        up = ""
        if p.get("ready_at") and st in ("ready", "unhealthy"):
            up = _dur(now - p["ready_at"])
        elif p.get("started_at") and st == "starting":
            up = _dur(now - p["started_at"])
        t.add_row(name, Text(st, style=STATE_STYLE.get(st, "")), str(p.get("pid") or ""), p.get("url") or "",
                  str(p.get("restarts", "")) if st not in ("missing", "external") else "", up,
                  (p.get("detail") or "")[:70])
    ep = state.get("endpoints") or {}
    lines = Table.grid(padding=(0, 2))
    for k in ("dataplane_url", "controlplane_api", "kafka_bootstrap", "mlflow_tracking_uri", "database_url",
              "state_dir"):
        if ep.get(k):
            lines.add_row(Text(k, style="bold"), str(ep[k]))
    return Group(t, lines)


def _dur(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# --------------------------------------------------------------------------- commands


@_wrap
def cmd_up(args, settings) -> int:
    from rich.console import Console

    import stack

    parts = _parts(args, settings)
    fleet = {k: v for k, v in (("nodes", args.nodes), ("learners", args.learners), ("database", args.database))
             if v is not None}
    if fleet:
        try:
            settings.stack = with_fleet(settings.stack, fleet)
        except ValueError as e:
            raise stack.StackError(f"invalid --nodes / --learners / --database: {e}") from e
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    if args.detach:
        state = stack.read_state(settings)
        sup = (state or {}).get("supervisor") or {}
        if state and stack.pid_alive(sup.get("pid"), sup.get("start_time")):
            raise stack.StackError(f"a stack is already running under {settings.home} (supervisor pid "
                                   f"{sup['pid']}); see `adaflash status`, stop it with `adaflash down`")
        extra = []
        if args.random_ports:
            extra.append("--random-ports")
        extra += ["--only", ",".join(parts)]
        for k, v in fleet.items():
            extra += [f"--{k}", str(v)]
        pid = stack.spawn_detached(settings, args.config, extra)
        timeout = args.timeout if args.timeout is not None else settings.stack.ready_timeout_s
        seen: dict[str, str] = {}

        def progress(st: dict) -> None:
            if args.json:
                return
            for name, p in st.get("processes", {}).items():
                if seen.get(name) != p.get("state"):
                    seen[name] = p.get("state")
                    console.print(f"  {name:<13} {p.get('state')}  {p.get('url') or ''}")

        try:
            state = stack.wait_ready(settings, pid, timeout, on_change=progress)
        except stack.StackError:
            stack.down(settings)
            raise
        if args.json:
            print(json.dumps(stack.live_status(settings), indent=2))
        else:
            console.print(render_table(stack.live_status(settings)))
            console.print("stack ready; `adaflash status` shows it, `adaflash down` stops it")
        return 0

    sup = stack.Supervisor(settings, config=args.config, random_ports=args.random_ports, parts=parts)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    if args.supervise or not console.is_terminal:
        last: dict[str, str] = {}

        def log_change(st: dict) -> None:
            for name, p in st.get("processes", {}).items():
                line = f"{p.get('state')} {p.get('detail') or ''}".strip()
                if last.get(name) != line:
                    last[name] = line
                    print(f"{time.strftime('%H:%M:%S')} {name:<13} {line}", flush=True)
            if last.get("_phase") != st.get("phase"):
                last["_phase"] = st.get("phase")
                print(f"{time.strftime('%H:%M:%S')} stack         {st.get('phase')}", flush=True)

        sup.on_change = log_change
        return sup.run()

    from rich.live import Live

    with Live(render_table(sup.snapshot()), console=console, refresh_per_second=2, transient=False) as live:
        sup.on_change = lambda st: live.update(render_table(st))
        sup.prepare()
        try:
            while not sup._stop:
                sup.tick()
                if sup.phase == "starting" and sup.ready:
                    sup.phase = "ready"
                    sup._save()
                live.update(render_table(sup.snapshot()))
                time.sleep(0.25)
        finally:
            left = sup.stop_all()
            live.update(render_table(sup.snapshot()))
    if left:
        console.print(f"[red]processes still alive after stop: {left}[/red]")
        return 1
    return 0


@_wrap
def cmd_down(args, settings) -> int:
    import stack

    res = stack.down(settings, args.timeout)
    print(res["message"] + (f" ({', '.join(res['stopped'])})" if res["stopped"] else ""))
    return 0 if not res["leftover"] else 1


@_wrap
def cmd_status(args, settings) -> int:
    import stack

    st = stack.live_status(settings)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        from rich.console import Console

        if st.get("phase") == "absent":
            print(f"no stack under {st['endpoints']['state_dir']} (start one with `adaflash up`)")
        else:
            console = Console()
            if not console.is_terminal:  # piped: no terminal width to fit, keep every column
                console.width = max(console.width, 140)
            console.print(render_table(st))
            missing = {k: v for k, v in (st.get("missing") or {}).items() if v != "not selected"}
            for k, v in missing.items():
                print(f"  {k}: {v}")
    return 0 if st.get("running") else 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)


def with_fleet(stack_cfg, fleet: dict):
    """The stack section with ``--nodes`` / ``--learners`` / ``--database`` applied, validated.
    Only the fields already set are carried over, so unset learner overrides stay unset
    (dumping every field would set each to None and hand the learners "None")."""
    return stack_cfg.model_validate({**stack_cfg.model_dump(exclude_unset=True), **fleet})
