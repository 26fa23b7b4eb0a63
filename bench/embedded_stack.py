"""An embedded control plane with real pieces, for bench/promotion.py and the rollout tests.

MLflow on SQLite with local artifacts, the control-plane database (SQLite), the admin
API over real HTTP, serving nodes (dataplane.node.Node on a target model, each over
real HTTP with its reconciler heartbeating the control plane), and the workers driven
pass by pass (``Stack.drive``) so a test decides when the control plane runs.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
import yaml

from adaflash import credentials
from adaflash.config import Settings, load_config
from adaflash.contracts.admin_api import VersionDetail
from adaflash.contracts.manifest import Lineage
from adaflash.controlplane_client import ControlPlaneClient
from controlplane.api import create_app as create_cp_app
from controlplane.gates import DEFAULT_POLICY_PATH, load_policy
from controlplane.registry import Registry, publish_candidate
from controlplane.rollout import NodePusher, RolloutReconciler
from controlplane.shadow import RecordsWindow, ShadowEvaluator
from controlplane.worker import Workers

NODE_ADMIN_TOKEN = secrets.token_urlsafe(24)  # the embedded nodes' admin key, new per process


class LiveServer:
    """uvicorn in a thread on a random loopback port."""

    def __init__(self, app, port: int = 0):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                break
            time.sleep(0.025)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def relaxed_policy(path: Path, approval: str = "required", **rollout) -> Path:
    """The default policy with thresholds a random tiny drafter can meet, and a short watch."""
    data = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    data["policy_version"] = "test.1"
    data["approval"] = approval
    data["gates"].update(min_tau_gain=-0.5, max_tenant_regression=0.5, max_domain_regression=0.5,
                         min_slice_records=1, calibration_mae_max=1.0, min_eval_records=4)
    data["rollout"].update({"canary_fraction": 0.5, "watch_window_s": 0.5, "min_watch_heartbeats": 2,
                            "max_live_tau_regression": 0.3, "max_live_tps_regression": 0.99,
                            "max_live_error_rate": 0.01, "converge_timeout_s": 60, "post_promotion_watch_s": 30,
                            **rollout})
    path.write_text(yaml.safe_dump(data))
    return path


def online_lineage(parent: str | None = "1") -> Lineage:
    from datetime import UTC, datetime, timedelta

    from adaflash.contracts.manifest import OffsetRange

    now = datetime.now(UTC)
    return Lineage(topic="adaflash.feedback.v1", offsets=[OffsetRange(partition=0, start=0, end=99)],
                   tenants=["acme", "globex"], window_start=now - timedelta(hours=6), window_end=now,
                   parent_version=parent, source="online")


@dataclass
class ServingNode:
    node_id: str
    node: object
    server: LiveServer | None = None
    reconciler: object | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def drafter(self) -> dict:
        r = httpx.get(f"{self.url}/admin/drafter", headers={"Authorization": f"Bearer {NODE_ADMIN_TOKEN}"},
                      timeout=10)
        r.raise_for_status()
        return r.json()


@dataclass
class Stack:
    settings: Settings
    registry: Registry
    cp: LiveServer
    admin_token: str
    target: object
    tokenizer: object
    identity: dict
    target_dir: Path
    workers: Workers
    bundles: Path
    nodes: dict[str, ServingNode] = field(default_factory=dict)
    node_keys: dict[str, str] = field(default_factory=dict)
    reconcile_interval_s: float = 0.25
    clients: list[ControlPlaneClient] = field(default_factory=list)
    admin: ControlPlaneClient = field(init=False)  # the admin's typed client of the control plane's API

    def __post_init__(self) -> None:
        self.admin = self.client(self.admin_token)

    # -- control plane --
    def client(self, token: str) -> ControlPlaneClient:
        """A typed client of the control plane's API with ``token`` (closed with the stack)."""
        c = ControlPlaneClient(self.cp.url, token)
        self.clients.append(c)
        return c

    def key(self, role: str, node_id: str | None = None) -> str:
        """A new API key of ``role`` (a node key names its node)."""
        return self.admin.create_key(f"{role}-{node_id or ''}", role, node_id=node_id).key

    def drive(self, cond: Callable[[], bool], timeout: float = 60.0, what: str = "", shadow: bool = True,
              workers: Workers | None = None) -> float:
        """Run worker passes until ``cond()``; returns the seconds it took."""
        w = workers or self.workers
        t0 = time.monotonic()
        while True:
            w.rollout_pass()
            if shadow:
                w.shadow_pass()
            if cond():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not reached in {timeout:g} s: {what}")
            time.sleep(0.05)

    def version(self, v: str) -> VersionDetail:
        return self.admin.get_version(v)

    def state(self, v: str) -> str:
        return self.version(v).state

    # -- drafters --
    def bundle(self, name: str, seed: int, lineage: Lineage | None = None, version: str | None = None) -> Path:
        from dataplane.drafter import new_drafter
        from dataplane.drafter_io import save_bundle

        d = self.bundles / name
        if not d.exists():
            drafter = new_drafter(self.target, seed=seed, num_layers=1, n_target_layers=2,
                                  block_size=self.settings.dataplane.block_size)
            save_bundle(drafter, d, self.identity, version=version or name,
                        lineage=lineage if lineage is not None else online_lineage())
        return d

    def publish(self, seed: int, lineage: Lineage | None = None) -> str:
        """What the learner does: one run and one registered version. Returns the version."""
        nxt = str(len(self.registry.list_versions()) + 1)
        return publish_candidate(self.registry, self.bundle(f"cand-{nxt}-{seed}", seed, lineage, nxt),
                                 params={"seed": seed}).version

    # -- nodes --
    def start_node(self, node_id: str, initial: Path) -> ServingNode:
        from dataplane.node import Node
        from dataplane.reconcile import Reconciler
        from dataplane.server import create_app

        s = self.settings.model_copy(deep=True)
        s.home = self.settings.home / node_id
        s.dataplane.node_id = node_id
        s.dataplane.drafter = str(initial)
        node = Node(s, target=self.target, tokenizer=self.tokenizer, target_dir=self.target_dir)
        node.engine.start()
        server = LiveServer(create_app(node, NODE_ADMIN_TOKEN)).__enter__()
        if node_id not in self.node_keys:
            self.node_keys[node_id] = self.key("node", node_id)
        rec = Reconciler(node, self.cp.url, self.node_keys[node_id], server.url, self.reconcile_interval_s)
        rec.tick()  # registers the node before the caller goes on
        rec.start()
        sn = ServingNode(node_id, node, server, rec)
        self.nodes[node_id] = sn
        return sn

    def stop_node(self, node_id: str) -> None:
        sn = self.nodes.pop(node_id)
        sn.reconciler.stop()
        sn.server.__exit__()
        sn.node.engine.stop()

    def close(self) -> None:
        for nid in list(self.nodes):
            self.stop_node(nid)
        self.workers.stop(timeout_s=5)
        for c in self.clients:
            c.close()
        self.cp.__exit__()


def tiny_target_dir(root: Path, real_target_dir: Path) -> Path:
    """A tiny random target with the real tokenizer's vocabulary (as the dataplane tests use)."""
    from tests.tiny_models import save_tiny

    d = save_tiny(root, vocab=49152, hidden=32, layers=2, heads=2, kv_heads=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = Path(real_target_dir) / f
        if src.exists():
            (d / f).write_bytes(src.read_bytes())
    return d


def build_stack(root: Path, target_dir: Path, records: list, *, policy_overrides: dict | None = None,
                approval: str = "required", max_model_len: int = 512) -> Stack:
    from dataplane.runner import ModelRunner
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer

    home = root / "home"
    settings = load_config(home=home)
    settings.model.path = str(target_dir)
    settings.model.max_model_len = max_model_len
    settings.dataplane.block_size = 8
    settings.dataplane.max_prompt_tokens = 200
    settings.dataplane.max_new_tokens_limit = 64
    settings.dataplane.breakeven = False
    cp = settings.controlplane
    cp.mlflow_tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    cp.policy_file = str(relaxed_policy(root / "policy.yaml", approval, **(policy_overrides or {})))
    cp.heartbeat_timeout_s = 2.0
    cp.rollout_lease_s = 1.0
    cp.feedback_source = "none"
    target = ModelRunner.reference().load_target(target_dir)  # float32 on CPU, for the nodes and the evaluator
    tokenizer = Tokenizer(target_dir)
    identity = target_identity(target_dir)
    settings.model.target_id = identity["id"]
    registry = Registry(cp.mlflow_tracking_uri, identity["id"], artifact_root=root / "mlartifacts")
    app = create_cp_app(settings)
    server = LiveServer(app).__enter__()
    token = credentials.lookup(credentials.controlplane_admin(settings))  # written by create_cp_app
    if not token:
        raise RuntimeError(f"the control plane wrote no admin key at {credentials.controlplane_admin(settings).path}")
    policy = load_policy(cp.policy_file)
    evaluator = ShadowEvaluator(settings, app.state.sessions, registry, policy, RecordsWindow(records),
                                target=target, tokenizer=tokenizer, target_identity=identity, retry_s=1.0)
    reconciler = RolloutReconciler(app.state.sessions, policy, settings, registry=registry,
                                   pusher=NodePusher(NODE_ADMIN_TOKEN, timeout_s=60, retry_s=1.0))
    workers = Workers(settings, app.state.sessions, policy, registry=registry, evaluator=evaluator,
                      reconciler=reconciler)
    bundles = root / "bundles"
    bundles.mkdir()
    return Stack(settings, registry, server, token, target, tokenizer, identity, Path(target_dir), workers, bundles)


def feedback_records(tokenizer, n: int = 12, now=None, target_id: str = "tiny-llama") -> list:
    """Held-out records of two tenants and two domains (text the tiny target's tokenizer reads)."""
    from tests.controlplane.shadow_util import evaluation_ids, record

    texts = ["The quick brown fox jumps over the lazy dog and keeps running through the field.",
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
             "Once upon a time there was a small village by the sea where fishermen lived.",
             "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;"]
    ids = evaluation_ids(n)
    return [record(rid, "Continue: " + texts[i % 4][:20], texts[i % 4], tenant="acme" if i % 2 else "globex",
                   domain="code" if i % 4 in (1, 3) else "chat", target_id=target_id, now=now)
            for i, rid in enumerate(ids)]


class Traffic:
    """A client that keeps sending completions to the live nodes; every answer must be a 200."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                nodes = list(self.stack.nodes.values())
                if not nodes:
                    time.sleep(0.05)
                    continue
                sn = nodes[i % len(nodes)]
                i += 1
                try:
                    r = c.post(f"{sn.url}/v1/completions", headers={"X-Tenant-ID": "acme"},
                               json={"prompt": f"Hello number {i}", "max_tokens": 6, "temperature": 0})
                    if r.status_code == 200 and r.json()["choices"][0]["text"] is not None:
                        self.ok += 1
                    else:
                        self.failures.append(f"{sn.node_id}: HTTP {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    if sn.node_id in self.stack.nodes:  # a node taken down on purpose is not a failure
                        self.failures.append(f"{sn.node_id}: {type(e).__name__}: {e}")
                time.sleep(0.02)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
