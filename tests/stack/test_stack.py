"""``adaflash up`` / ``status`` / ``down`` on the light parts: real Tansu broker, MLflow
server, control plane and a node on a tiny target, as supervised processes."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from adaflash.config import load_config
from adaflash.stack_state import pid_alive
from stack.plan import learner_override_env, plan_stack
from stack.procs import group_members
from stack.services import ALL_PARTS
from tests.stack.conftest import adaflash, log_tails, status, tiny_env

pytestmark = pytest.mark.services


def test_plan_reports_missing_parts_and_wires_children(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HOME", str(tmp_path))
    settings = load_config()
    services, missing, endpoints = plan_stack(settings, random_ports=True,
                                              parts=["broker", "controlplane", "dataplane"])
    names = [s.name for s in services]
    assert names == [p for p in ALL_PARTS if p in names]
    assert missing["mlflow"] == "not selected" and "learner" in missing
    node = next(s for s in services if s.name == "dataplane")
    env = node.env
    assert env["ADAFLASH_HOME"] == str(tmp_path.resolve())
    assert env["ADAFLASH_KAFKA__BOOTSTRAP"] == endpoints["kafka_bootstrap"]
    assert env["ADAFLASH_DATAPLANE__CONTROLPLANE_URL"] == endpoints["controlplane_url"]
    assert env["ADAFLASH_DATAPLANE__CONTROLPLANE_TOKEN_FILE"].endswith("node-token")
    assert node.before_start is not None  # the node key is made before the node starts
    ports = [s.port for s in services if s.port]
    assert len(set(ports)) == len(ports)
    for key in ("dataplane_url", "controlplane_url", "kafka_bootstrap", "state_dir"):
        assert endpoints[key]


def test_learner_overrides_leave_explicit_learner_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HOME", str(tmp_path))
    monkeypatch.setenv("ADAFLASH_LEARNER__BUFFER_SIZE", "8")
    settings = load_config()
    env = learner_override_env(settings)
    assert "ADAFLASH_LEARNER__BUFFER_SIZE" not in env  # set by the operator: left alone
    assert env["ADAFLASH_LEARNER__ANCHORS_PER_RECORD"] == str(settings.stack.learner_overrides.anchors_per_record)
    services, _, _ = plan_stack(settings, random_ports=True, parts=["broker", "learner"])
    learner = next(s for s in services if s.name == "learner")
    assert learner.env["ADAFLASH_LEARNER__ANCHORS_PER_RECORD"] == env["ADAFLASH_LEARNER__ANCHORS_PER_RECORD"]


def _wait(pred, timeout: float, what: str, home=None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{log_tails(home)}" if home else ""))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_vocab_target, tiny_bundle):
    home = tmp_path_factory.mktemp("stack-home")
    # feedback off: the scrubber (Presidio) and the learner belong to the closed-loop test
    env = tiny_env(home, tiny_vocab_target, tiny_bundle, ADAFLASH_GOVERNANCE__FEEDBACK_ENABLED="false")
    t0 = time.monotonic()
    r = adaflash(env, "up", "--detach", "--random-ports", "--without", "learner", "--json", timeout=400,
                 check=False)
    if r.returncode != 0:
        raise AssertionError(f"up failed: {r.stderr[-2000:]}\n{log_tails(home)}")
    started = json.loads(r.stdout)
    started["_up_s"] = time.monotonic() - t0
    yield env, home, started
    adaflash(env, "down", check=False, timeout=120)


def test_up_status_lists_every_endpoint_and_process(stack):
    env, home, started = stack
    st = status(env)
    assert st["running"] and st["phase"] == "ready"
    ep = st["endpoints"]
    assert ep["state_dir"] == str(home.resolve())
    for key in ("dataplane_url", "controlplane_url", "kafka_bootstrap", "mlflow_tracking_uri", "database_url"):
        assert ep[key], key
    for name in ("broker", "mlflow", "controlplane", "dataplane"):
        p = st["processes"][name]
        assert p["state"] == "ready" and p["alive"] and pid_alive(p["pid"], p["start_time"]), p
        assert os.path.isfile(p["log"])
    assert st["processes"]["learner"]["state"] == "missing"
    # every endpoint answers
    assert httpx.get(f"{ep['dataplane_url']}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{ep['controlplane_url']}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{ep['mlflow_tracking_uri']}/health", timeout=5).status_code == 200
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=ep["kafka_bootstrap"], request_timeout_ms=5000)
    try:
        assert "adaflash.feedback.v1" in admin.list_topics()
    finally:
        admin.close()
    # a request is served, and the node reconciles with the control plane under its own key
    r = httpx.post(f"{ep['dataplane_url']}/v1/completions", json={"prompt": "Hello", "max_tokens": 8},
                   headers={"X-Tenant-ID": "acme"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["speculative"]["drafter_version"] == "v0"
    token = (home / "admin-token").read_text().strip()

    def node_seen():
        r = httpx.get(f"{ep['controlplane_api']}/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5)
        return [n for n in r.json() if n["node_id"] == "node-1"] if r.status_code == 200 else None

    _wait(node_seen, 30, "the node's heartbeat", home)
    # the node's admin endpoint takes the control plane's admin key
    r = httpx.get(f"{ep['dataplane_url']}/admin/drafter", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert r.status_code == 200 and r.json()["version"] == "v0"


def test_killed_children_are_restarted(stack):
    env, home, _ = stack
    before = status(env)["processes"]
    for name in ("dataplane", "broker"):
        os.kill(before[name]["pid"], signal.SIGKILL)

    def restarted():
        st = status(env)
        ps = st["processes"]
        ok = all(ps[n]["restarts"] >= 1 and ps[n]["state"] == "ready" and ps[n]["alive"]
                 and ps[n]["pid"] != before[n]["pid"] for n in ("dataplane", "broker"))
        return st if ok else None

    st = _wait(restarted, 180, "the restarts", home)
    assert st["processes"]["controlplane"]["restarts"] == 0
    # the restarted broker has its topics again (memory storage forgets them)
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=st["endpoints"]["kafka_bootstrap"], request_timeout_ms=5000)
    try:
        assert "adaflash.feedback.v1" in admin.list_topics()
    finally:
        admin.close()
    r = httpx.post(f"{st['endpoints']['dataplane_url']}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200


def test_demo_drives_traffic_and_reports(stack):
    """No learner runs here, so no candidate can appear: the demo measures, waits, says so."""
    env, home, _ = stack
    r = adaflash(env, "demo", "--timeout", "3", "--requests", "1", "--max-tokens", "6", "--concurrency", "2",
                 check=False, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no promotion within the deadline" in r.stdout and "learner is missing" in r.stdout
    summary = json.loads((home / "demo" / "demo.json").read_text())
    assert summary["baseline_version"] == "v0" and summary["promoted_version"] is None
    by = {row["domain"]: row for row in summary["rows"]}
    assert set(by) == {"web-desk", "all"} and by["all"]["n"] >= 1 and by["all"]["tau_before"] >= 1.0
    # the measurement ran under a learning hold that took effect, and the hold is lifted again
    assert [(h["phase"], h["held"], h["quiet"]) for h in summary["measurement_holds"]] == [("before", True, True)]
    assert "under a learning hold" in r.stdout
    assert (home / "demo" / "demo.png").stat().st_size > 1000
    token = (home / "admin-token").read_text().strip()
    ep = status(env)["endpoints"]
    pol = httpx.get(f"{ep['controlplane_api']}/tenants/demo-eval/policy", timeout=5,
                    headers={"Authorization": f"Bearer {token}"}).json()
    assert pol["opt_out"] is True  # what the demo measures is never learned from
    hold = httpx.get(f"{ep['controlplane_api']}/hold", timeout=5, headers={"Authorization": f"Bearer {token}"}).json()
    assert hold["learning"] is False and hold["evaluation"] is False


def test_down_leaves_no_process(stack):
    env, home, _ = stack
    st = status(env)
    pids = [(p["pid"], p["start_time"]) for p in st["processes"].values() if p.get("pid")]
    sup = st["supervisor"]
    assert len(pids) == 4
    r = adaflash(env, "down", timeout=120)
    assert "stopped" in r.stdout
    assert not pid_alive(sup["pid"], sup["start_time"])
    for pid, start in pids:
        assert not pid_alive(pid, start)
        assert group_members(pid) == []  # nothing the child spawned survives either
    st = status(env)
    assert not st["running"] and st["phase"] == "stopped"
    assert all(p["state"] in ("stopped", "missing") for p in st["processes"].values())
    # down again is harmless
    adaflash(env, "down")


def test_plan_of_two_nodes_and_two_learners_on_postgres(tmp_path, monkeypatch):
    """Every instance gets its own port, id, key file, spool, checkpoint directory; the
    learners share one consumer group; the control plane waits for both learners' deletion
    acknowledgements and runs on this run's own PostgreSQL database."""
    monkeypatch.setenv("ADAFLASH_HOME", str(tmp_path))
    settings = load_config(stack={"nodes": 2, "learners": 2, "database": "postgres"})
    services, _, endpoints = plan_stack(settings, random_ports=True)
    names = [s.name for s in services]
    assert names == ["broker", "mlflow", "controlplane", "dataplane", "dataplane-2", "learner", "learner-2"]
    nodes = [s for s in services if s.kind == "dataplane"]
    assert [s.env["ADAFLASH_DATAPLANE__NODE_ID"] for s in nodes] == ["node-1", "node-2"] == endpoints["node_ids"]
    assert len({s.port for s in services if s.port}) == len([s for s in services if s.port])
    assert endpoints["dataplane_urls"] == [s.url for s in nodes]
    assert len({s.env["ADAFLASH_DATAPLANE__CONTROLPLANE_TOKEN_FILE"] for s in nodes}) == 2
    assert nodes[1].env["ADAFLASH_GOVERNANCE__SPOOL_PATH"].endswith("spool-node-2.db")
    learners = [s for s in services if s.kind == "learner"]
    assert learners[1].env["ADAFLASH_LEARNER__LEARNER_ID"] == "learner-2"
    assert learners[1].env["ADAFLASH_LEARNER__STATE_DIR"] != str(tmp_path / "learner")
    assert not any("CONSUMER_GROUP" in k for s in learners for k in s.env)  # one group: the configured one
    cp = next(s for s in services if s.name == "controlplane")
    assert json.loads(cp.env["ADAFLASH_CONTROLPLANE__DELETION_LEARNERS"]) == ["learner", "learner-2"]
    name = endpoints["postgres_database"]
    assert name and cp.env["ADAFLASH_CONTROLPLANE__DATABASE_URL"].endswith("/" + name)
    assert endpoints["database_url"] == cp.env["ADAFLASH_CONTROLPLANE__DATABASE_URL"]


def test_stack_postgres_database_is_created_once_and_dropped(tmp_path):
    from controlplane.db import upgrade
    from stack import parts as stack_parts

    dsn = load_config().stack.postgres_admin_dsn
    name = stack_parts.new_database_name()
    try:
        assert stack_parts.create_database(dsn, name) is True
        assert stack_parts.create_database(dsn, name) is False  # a restarted control plane keeps it
        upgrade(stack_parts.database_url(dsn, name))
    finally:
        stack_parts.drop_database(dsn, name)
    assert stack_parts.create_database(dsn, name) is True  # it was gone
    stack_parts.drop_database(dsn, name)


def test_fleet_flags_leave_learner_overrides_unset(tmp_path, monkeypatch):
    from adaflash.config import load_config
    from stack.cli import with_fleet

    monkeypatch.setenv("ADAFLASH_LEARNER__BUFFER_SIZE", "8")
    settings = load_config(home=tmp_path)
    settings.stack = with_fleet(settings.stack, {"nodes": 2, "learners": 2})
    assert (settings.stack.nodes, settings.stack.learners) == (2, 2)
    env = learner_override_env(settings)
    # the defaults the learner section does not set, never a "None" for the others
    assert env == {"ADAFLASH_LEARNER__ANCHORS_PER_RECORD": "4", "ADAFLASH_LEARNER__MAX_WAIT_S": "45.0"}
