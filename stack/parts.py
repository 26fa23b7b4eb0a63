"""Serving nodes and learners of the embedded stack, as many as asked, and its database.

``adaflash up --nodes N --learners M`` runs N nodes (ids ``node-1``, ``node-2``, ...; the
first keeps ``stack.node_id``) and M learners in one consumer group (ids ``learner``,
``learner-2``, ...). Each instance has its own port, API key file, spool, usage-audit
database, trace file and (learners) checkpoint directory under $ADAFLASH_HOME; the first
of each keeps the single-instance paths. The control plane waits for every learner's
acknowledgement of a deletion (``controlplane.deletion_learners``).

``--database postgres`` puts the control plane on a fresh PostgreSQL database of its own
for this run (``stack.postgres_admin_dsn``), created before the control plane starts and
dropped by ``adaflash down``.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from adaflash.config import Settings
from adaflash.controlplane_client import ControlPlaneClient, ControlPlaneError
from adaflash.credentials import LEARNER_TOKEN_FILE, NODE_TOKEN_FILE, read_file, write_private
from stack.services import Service, StackError, cli_argv, http_ok


def instance_ids(first: str, n: int) -> list[str]:
    """``first`` and n - 1 more: ``node-1`` -> node-2, node-3; ``learner`` -> learner-2, ..."""
    base = first[:-2] if first.endswith("-1") else first
    ids = [first]
    i = 2
    while len(ids) < n:
        cand = f"{base}-{i}"
        if cand not in ids:
            ids.append(cand)
        i += 1
    return ids


def node_services(settings: Settings, config: str | None, host: str, first_port: int, cp_url: str,
                  admin_token: Path, taken: set[int], random_ports: bool) -> list[Service]:
    from stack.plan import choose_port

    sc, home = settings.stack, Path(settings.home).resolve()
    out = []
    for i, node_id in enumerate(instance_ids(sc.node_id, sc.nodes)):
        port = first_port if i == 0 else choose_port(first_port + i, random_ports, taken)
        url = f"http://{host}:{port}"
        token = home / (NODE_TOKEN_FILE if i == 0 else f"{NODE_TOKEN_FILE}-{node_id}")
        env = {"ADAFLASH_DATAPLANE__PORT": str(port), "ADAFLASH_DATAPLANE__NODE_ID": node_id}
        if i:
            gov = home / "governance"
            env.update({"ADAFLASH_GOVERNANCE__SPOOL_PATH": str(gov / f"spool-{node_id}.db"),
                        "ADAFLASH_GOVERNANCE__USAGE_DB_PATH": str(gov / f"usage-{node_id}.db"),
                        "ADAFLASH_TELEMETRY__FILE_PATH": str(home / f"traces-{{service}}-{node_id}.jsonl")})
        before = None
        if cp_url:
            env.update({"ADAFLASH_DATAPLANE__CONTROLPLANE_URL": cp_url,
                        "ADAFLASH_DATAPLANE__CONTROLPLANE_TOKEN_FILE": str(token)})

            def before(svc, node_id=node_id, token=token) -> None:
                ensure_node_key(cp_url, admin_token, token, node_id)
                # the node reads the key from the file; the variable (which wins) is set too,
                # so a stale one inherited from the shell cannot shadow the fresh key
                svc.env[settings.dataplane.controlplane_token_env] = read_file(token) or ""
        name = "dataplane" if i == 0 else f"dataplane-{i + 1}"
        out.append(Service(name, cli_argv(config, "serve", "--host", host, "--port", str(port)), env,
                           lambda url=url: http_ok(f"{url}/readyz"), port, url, before_start=before,
                           kind="dataplane"))
    return out


def learner_services(settings: Settings, config: str | None, cp_url: str, admin_token: Path) -> list[Service]:
    from stack.plan import learner_override_env

    home = Path(settings.home).resolve()
    out = []
    for i, learner_id in enumerate(learner_ids(settings)):
        env: dict[str, str] = {"ADAFLASH_LEARNER__LEARNER_ID": learner_id} if i else {}
        if i:
            env.update({"ADAFLASH_LEARNER__STATE_DIR": str(home / f"learner-{i + 1}"),
                        "ADAFLASH_TELEMETRY__FILE_PATH": str(home / f"traces-{{service}}-{learner_id}.jsonl")})
        before = None
        if cp_url:  # the learner acknowledges tenant deletions and claims the records it trains
            token = home / (LEARNER_TOKEN_FILE if i == 0 else f"{LEARNER_TOKEN_FILE}-{learner_id}")
            env.update({"ADAFLASH_LEARNER__CONTROLPLANE_URL": cp_url,
                        "ADAFLASH_LEARNER__CONTROLPLANE_TOKEN_FILE": str(token)})

            def before(svc, learner_id=learner_id, token=token) -> None:
                ensure_node_key(cp_url, admin_token, token, learner_id, role="learner")
        env.update(learner_override_env(settings))
        name = "learner" if i == 0 else f"learner-{i + 1}"
        out.append(Service(name, cli_argv(config, "learner"), env, lambda: (True, "running"), before_start=before,
                           kind="learner"))
    return out


def ensure_node_key(cp_url: str, admin_token_path: Path, node_token_path: Path, node_id: str,
                    role: str = "node") -> None:
    """Make sure ``node_token_path`` holds a valid key of ``role`` (node or learner) bound to
    ``node_id``, creating one through the control plane's admin API (with the admin key in
    ``admin_token_path``)."""
    tok = read_file(node_token_path)
    if tok:
        try:
            with ControlPlaneClient(cp_url, tok, timeout_s=10) as cp:
                if cp.whoami().node_id == node_id:
                    return
        except ControlPlaneError:
            pass
    admin = read_file(admin_token_path)
    if not admin:
        raise StackError(f"the control plane wrote no admin key at {admin_token_path}")
    try:
        with ControlPlaneClient(cp_url, admin, timeout_s=10) as cp:
            created = cp.create_key(f"stack-{role}-{node_id}", role, node_id=node_id)
    except ControlPlaneError as e:
        raise StackError(f"cannot create the {role} key: {e}") from e
    write_private(node_token_path, created.key + "\n")


def learner_ids(settings: Settings) -> list[str]:
    return instance_ids(settings.learner.learner_id, settings.stack.learners)


def controlplane_env(settings: Settings, database_url: str | None) -> dict[str, str]:
    """What the control plane of a multi-instance stack needs on top of the single one."""
    env = {}
    if settings.stack.learners > 1:
        env["ADAFLASH_CONTROLPLANE__DELETION_LEARNERS"] = json.dumps(learner_ids(settings))
    if database_url:
        env["ADAFLASH_CONTROLPLANE__DATABASE_URL"] = database_url
    return env


# --------------------------------------------------------------------------- PostgreSQL


def new_database_name() -> str:
    return f"adaflash_stack_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"


def database_url(admin_dsn: str, name: str) -> str:
    base = admin_dsn.rsplit("/", 1)[0]
    return f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}"


def create_database(admin_dsn: str, name: str) -> bool:
    """Create ``name`` unless it exists; True when it was created now."""
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
        return True


def drop_database(admin_dsn: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
