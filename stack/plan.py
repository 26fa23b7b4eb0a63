"""The plan of an embedded stack: which parts run, on which ports, with which settings.

``plan_stack`` turns the settings into the services to supervise, the parts left out
(and why), and the stack's endpoints as ``adaflash status --json`` shows them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaflash.config import Settings
from adaflash.credentials import ADMIN_TOKEN_FILE, NODE_TOKEN_FILE
from governance.broker import free_port
from stack import parts as stack_parts
from stack.procs import port_free
from stack.services import (
    ALL_PARTS,
    Service,
    StackError,
    cli_argv,
    ensure_topics,
    find_tansu,
    http_ok,
    kafka_ok,
    part_available,
)

HOST = "127.0.0.1"
DEMO_POLICY = Path(__file__).resolve().parent / "demo_policy.yaml"


@dataclass
class Layout:
    """Where the planned parts live: ports, URLs, token files and the database."""

    home: Path
    run: list[str]
    ports: dict[str, int | None]
    bootstrap: str
    mlflow_uri: str
    cp_url: str
    node_url: str
    admin_token: Path
    db_url: str
    pg_name: str | None
    policy: str


def choose_port(wanted: int, random_ports: bool, taken: set[int]) -> int:
    """``wanted`` when it is free and random ports are not asked for, else a free one."""
    if not random_ports and wanted and wanted not in taken and port_free(wanted):
        port = wanted
    else:
        port = free_port()
        while port in taken:
            port = free_port()
    taken.add(port)
    return port


def select_parts(settings: Settings, parts: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The parts to run and those left out (name -> why)."""
    wanted = list(parts or settings.stack.parts)
    unknown = [p for p in wanted if p not in ALL_PARTS]
    if unknown:
        raise StackError(f"unknown stack part(s) {', '.join(unknown)}; known: {', '.join(ALL_PARTS)}")
    missing: dict[str, str] = {}
    for p in ALL_PARTS:
        why = "not selected" if p not in wanted else part_available(p)
        if why:
            missing[p] = why
    return [p for p in ALL_PARTS if p not in missing], missing


def _layout(settings: Settings, run: list[str], missing: dict[str, str], random_ports: bool,
            taken: set[int]) -> Layout:
    sc, home = settings.stack, Path(settings.home).resolve()
    kafka_host, _, kafka_port = settings.kafka.bootstrap.rpartition(":")
    wanted = {"broker": int(kafka_port or 9092) if kafka_host in ("127.0.0.1", "localhost") else 0,
              "mlflow": sc.mlflow_port, "controlplane": settings.controlplane.port,
              "dataplane": settings.dataplane.port}
    ports = {p: choose_port(w, random_ports, taken) if p in run else None for p, w in wanted.items()}
    bootstrap = f"{HOST}:{ports['broker']}" if ports["broker"] else settings.kafka.bootstrap
    external_mlflow = settings.controlplane.mlflow_tracking_uri
    if "mlflow" in run and external_mlflow:
        run.remove("mlflow")
        missing["mlflow"] = f"external: {external_mlflow}"
        ports["mlflow"] = None
    db_url = settings.controlplane.database_url or f"sqlite:///{home / 'controlplane.db'}"
    pg_name = None
    if sc.database == "postgres" and not settings.controlplane.database_url:
        pg_name = stack_parts.new_database_name()
        db_url = stack_parts.database_url(sc.postgres_admin_dsn, pg_name)
    return Layout(
        home=home, run=run, ports=ports, bootstrap=bootstrap,
        mlflow_uri=external_mlflow or (f"http://{HOST}:{ports['mlflow']}" if ports["mlflow"] else ""),
        cp_url=f"http://{HOST}:{ports['controlplane']}" if ports["controlplane"] else "",
        node_url=f"http://{HOST}:{ports['dataplane']}" if ports["dataplane"] else "",
        admin_token=Path(settings.controlplane.admin_token_file or home / ADMIN_TOKEN_FILE),
        db_url=db_url, pg_name=pg_name, policy=gate_policy_file(settings))


def _base_env(lay: Layout) -> dict[str, str]:
    env = {
        "ADAFLASH_HOME": str(lay.home),
        "ADAFLASH_KAFKA__BOOTSTRAP": lay.bootstrap,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PYTHONUNBUFFERED": "1",
        "TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS": "",
        "HF_HUB_OFFLINE": "1",
        # the node's admin endpoints take the control plane's admin key, so the control
        # plane (pushing drafters) and operators (runbooks) use one token
        "ADAFLASH_DATAPLANE__ADMIN_TOKEN_FILE": str(lay.admin_token),
    }
    if lay.mlflow_uri:
        env["ADAFLASH_CONTROLPLANE__MLFLOW_TRACKING_URI"] = lay.mlflow_uri
        env["MLFLOW_TRACKING_URI"] = lay.mlflow_uri
    return env


def _infrastructure(settings: Settings, config: str | None, lay: Layout) -> list[Service]:
    """The broker, MLflow and the control plane, as far as they run here."""
    out: list[Service] = []
    if "broker" in lay.run:
        url, bootstrap = f"tcp://{lay.bootstrap}", lay.bootstrap
        out.append(Service(
            "broker", [find_tansu() or "tansu", "broker", "--listener-url", url, "--advertised-listener-url", url,
                       "--storage-engine", "memory://tansu/"],
            {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}, lambda: kafka_ok(bootstrap), lay.ports["broker"],
            bootstrap, after_ready=lambda: ensure_topics(bootstrap, settings)))
    if "mlflow" in lay.run:
        port = lay.ports["mlflow"]
        out.append(Service(
            "mlflow", [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                       f"sqlite:///{lay.home / 'mlflow.db'}", "--artifacts-destination",
                       str(lay.home / "mlartifacts"), "--host", HOST, "--port", str(port), "--workers", "1"],
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, lambda: http_ok(f"{lay.mlflow_uri}/health"), port,
            lay.mlflow_uri))
    if "controlplane" in lay.run:
        port = lay.ports["controlplane"]
        env = {"ADAFLASH_CONTROLPLANE__PORT": str(port),
               **stack_parts.controlplane_env(settings, lay.db_url if lay.pg_name else None)}
        if lay.policy:
            env["ADAFLASH_CONTROLPLANE__POLICY_FILE"] = lay.policy

        def make_db(_svc: Service) -> None:
            if lay.pg_name:
                stack_parts.create_database(settings.stack.postgres_admin_dsn, lay.pg_name)
        out.append(Service(
            "controlplane", cli_argv(config, "controlplane", "--host", HOST, "--port", str(port)),
            env, lambda: http_ok(f"{lay.cp_url}/healthz"), port, lay.cp_url, before_start=make_db))
    return out


def _endpoints(settings: Settings, lay: Layout, services: list[Service]) -> dict[str, Any]:
    sc, cp_url = settings.stack, lay.cp_url
    return {
        "state_dir": str(lay.home),
        "logs_dir": str(lay.home / "logs"),
        "dataplane_url": lay.node_url or None,
        "dataplane_urls": [x.url for x in services if x.kind == "dataplane"],
        "node_ids": stack_parts.instance_ids(sc.node_id, sc.nodes) if "dataplane" in lay.run else [],
        "learner_ids": stack_parts.learner_ids(settings) if "learner" in lay.run else [],
        "postgres_database": lay.pg_name,
        "postgres_admin_dsn": sc.postgres_admin_dsn if lay.pg_name else None,
        "controlplane_url": cp_url or None,
        "controlplane_api": f"{cp_url}/api/v1" if cp_url else None,
        "kafka_bootstrap": lay.bootstrap,
        "mlflow_tracking_uri": lay.mlflow_uri or None,
        "database_url": lay.db_url,
        "admin_token_file": str(lay.admin_token),
        "gate_policy": lay.policy or "default",
        "node_token_file": str(lay.home / NODE_TOKEN_FILE) if cp_url and lay.node_url else None,
        "traces": str(lay.home / "traces-<service>.jsonl") if settings.telemetry.exporter == "file" else
        settings.telemetry.exporter,
    }


def plan_stack(settings: Settings, config: str | None = None, random_ports: bool | None = None,
               parts: list[str] | None = None) -> tuple[list[Service], dict[str, str], dict[str, Any]]:
    """The services to run, the parts left out (name -> why) and the stack's endpoints."""
    random_ports = settings.stack.random_ports if random_ports is None else random_ports
    run, missing = select_parts(settings, parts)
    taken: set[int] = set()
    lay = _layout(settings, run, missing, random_ports, taken)
    services = _infrastructure(settings, config, lay)
    if "dataplane" in lay.run:
        services += stack_parts.node_services(settings, config, HOST, lay.ports["dataplane"], lay.cp_url,
                                              lay.admin_token, taken, random_ports)
    if "learner" in lay.run:
        services += stack_parts.learner_services(settings, config, lay.cp_url, lay.admin_token)
    base_env = _base_env(lay)
    for s in services:
        s.env = {**base_env, **s.env}
    return services, missing, _endpoints(settings, lay, services)


def learner_override_env(settings: Settings) -> dict[str, str]:
    """``stack.learner_overrides`` as ADAFLASH_LEARNER__* variables, leaving out every field
    the learner section already sets (config file or environment)."""
    explicit = settings.learner.model_fields_set
    overrides = settings.stack.learner_overrides.model_dump(exclude_unset=True)
    return {f"ADAFLASH_LEARNER__{k.upper()}": str(v) for k, v in overrides.items()
            if k not in explicit and v is not None}


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
