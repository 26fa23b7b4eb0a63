"""The closed loop on tiny models, every part a real process of `adaflash up`:

    traffic -> feedback -> learner -> candidate -> evaluation -> gate -> promotion -> node serves it

Real Tansu broker, MLflow server (SQLite + artifacts), control plane on SQLite, a node on
a tiny target that shares the real tokenizer (feedback scrubbed by the real Presidio
scrubber process) and a learner. Each hop is its own test, in order, sharing one stack.

The control plane runs a lenient test gate policy (approval auto, short canary watch):
this test checks that every hop happens, not how good a drafter trained on a random tiny
target is. Every learner step publishes a candidate; one of them goes all the way.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.stack.conftest import adaflash, log_tails, loop_env, status

pytestmark = pytest.mark.services

N_REQUESTS = 60  # about one record in ten is held out for shadow evaluation
TENANTS = ("acme", "globex")
POLICY = """
policy_version: "test-loop"
gates:
  min_tau_gain: -1.0
  max_tenant_regression: 1.0
  max_domain_regression: 1.0
  min_slice_records: 100000
  calibration_mae_max: 1.0
  min_eval_records: 1
  require_lineage: true
  training_data_ttl: true
  candidate_ttl_hours: 72
approval: auto
rollout:
  canary_fraction: 1.0
  watch_window_s: 1
  max_live_tau_regression: 1.0
  max_live_tps_regression: 1.0
  max_live_error_rate: 1.0
  min_watch_heartbeats: 1
  converge_timeout_s: 120
  post_promotion_watch_s: 0
"""


def wait(pred, timeout: float, what: str, home=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" +
                         (f"\n{log_tails(home, 30)}" if home else ""))


class Loop:
    """What the hops learn about the running stack, passed from one hop to the next."""

    def __init__(self, env, home, st):
        self.env, self.home, self.st = env, home, st
        self.ep = st["endpoints"]
        self.admin = {"Authorization": f"Bearer {(home / 'admin-token').read_text().strip()}"}
        self.request_ids: list[str] = []
        self.candidates: set[str] = set()
        self.champion: str | None = None
        self.target_id: str | None = None

    def api(self, method: str, path: str, **kw):
        return httpx.request(method, f"{self.ep['controlplane_api']}{path}", headers=self.admin, timeout=30, **kw)


@pytest.fixture(scope="module")
def loop(tmp_path_factory, tiny_vocab_target, tiny_bundle):
    from dataplane.target_cache import target_identity

    home = tmp_path_factory.mktemp("loop-home")
    policy = home / "test-policy.yaml"
    policy.write_text(POLICY)
    env = loop_env(home, tiny_vocab_target, tiny_bundle, policy)
    r = adaflash(env, "up", "--detach", "--random-ports", "--json", timeout=600, check=False)
    if r.returncode != 0:
        raise AssertionError(f"up failed: {r.stderr[-2000:]}\n{log_tails(home)}")
    lp = Loop(env, home, json.loads(r.stdout))
    lp.target_id = target_identity(tiny_vocab_target)["id"]
    yield lp
    adaflash(env, "down", check=False, timeout=120)


def test_every_part_runs(loop):
    st = status(loop.env)
    for name in ("broker", "mlflow", "controlplane", "dataplane", "learner"):
        assert st["processes"][name]["state"] == "ready", (name, st["processes"][name])


def _metric(text: str, name: str, tenant: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tenant="{tenant}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_feedback_path_warms_up(loop):
    """The node scrubs in a child process that loads Presidio on first use; records that
    arrive before it is up are dropped (fail closed). Warm it up before measuring hops."""
    url = loop.ep["dataplane_url"]

    def emitted():
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 2},
                   headers={"X-Tenant-ID": "warmup"}, timeout=60)
        time.sleep(2.0)
        return _metric(httpx.get(f"{url}/metrics", timeout=10).text, "adaflash_feedback_emitted_total", "warmup")

    wait(emitted, 240, "the first scrubbed feedback record", loop.home)


def test_hop1_traffic_is_served_by_the_starting_drafter(loop):
    with httpx.Client(timeout=120) as c:
        for i in range(N_REQUESTS):
            tenant = TENANTS[i % 2]
            r = c.post(f"{loop.ep['dataplane_url']}/v1/chat/completions", headers={"X-Tenant-ID": tenant},
                       json={"messages": [{"role": "user", "content": f"Question {i}: why is the sky blue? "
                                                                        f"My email is jane{i}@example.com"}],
                             "max_tokens": 24, "ignore_eos": True, "domain": ("chat", "code")[i % 2]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["speculative"]["drafter_version"] == "v0"
            loop.request_ids.append(body["id"])


def test_hop2_feedback_reaches_the_broker_scrubbed(loop):
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=loop.ep["kafka_bootstrap"], enable_auto_commit=False,
                      consumer_timeout_ms=2000)
    try:
        parts = wait(lambda: c.topics() and c.partitions_for_topic("adaflash.feedback.v1"), 30,
                     "the feedback topic's partitions")
        tps = [TopicPartition("adaflash.feedback.v1", p) for p in parts]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        records: dict[str, tuple] = {}

        def enough():
            for m in c:
                v = json.loads(m.value)
                records[v["request_id"]] = (m.key.decode(), v, dict(m.headers))
            return len([r for r in loop.request_ids if r in records]) == N_REQUESTS

        wait(enough, 120, "the feedback records of every request", loop.home)
    finally:
        c.close()
    metrics = httpx.get(f"{loop.ep['dataplane_url']}/metrics", timeout=10).text
    assert sum(_metric(metrics, "adaflash_feedback_dropped_total", t) for t in TENANTS) == 0
    for rid in loop.request_ids:
        key, v, headers = records[rid]
        assert key == v["tenant_id"] and v["tenant_id"] in TENANTS
        assert "example.com" not in v["prompt_text"] and v["pii"]  # scrubbed before it left the node
        assert v["rounds"] and v["drafter_version"] == "v0"
        assert headers.get("traceparent", b"").startswith(b"00-")


def test_hop3_learner_publishes_a_candidate(loop):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=loop.ep["mlflow_tracking_uri"])
    name = f"adaflash-drafter-{loop.target_id}"

    def published():
        try:
            return client.search_model_versions(f"name='{name}'")
        except Exception:  # noqa: BLE001 - not registered yet
            return None

    versions = wait(published, 300, "a candidate in the MLflow registry", loop.home)
    for mv in versions:
        lineage = json.loads(mv.tags["adaflash.lineage"])
        assert lineage["topic"] == "adaflash.feedback.v1" and set(lineage["tenants"]) <= set(TENANTS) | {"warmup"}
        assert lineage["offsets"] and lineage["window_start"]
        loop.candidates.add(str(mv.version))


def _versions(loop) -> dict[str, dict]:
    return {v["version"]: v for v in loop.api("GET", "/versions").json()}


def _detail(loop, v) -> dict:
    return loop.api("GET", f"/versions/{v}").json()


def test_hop4_control_plane_discovers_the_candidates(loop):
    assert loop.candidates, "no candidate from the learner"
    found = wait(lambda: [v for k, v in _versions(loop).items() if k in loop.candidates], 120,
                 "the learner's candidates in the control plane", loop.home)
    for v in found:
        assert v["source_uri"] and v["manifest_sha256"] and v["lineage"]["topic"] == "adaflash.feedback.v1"


def test_hop5_shadow_evaluation_replays_held_out_feedback(loop):
    def evaluated():
        evs = loop.api("GET", "/evaluations").json()
        return [e for e in evs if e["status"] == "completed" and e["version"] in _versions(loop)]

    evs = wait(evaluated, 300, "a completed shadow evaluation", loop.home)
    rep = evs[0]["report"]
    assert rep["n_records"] >= 1 and rep["candidate"]["tau"] >= 1.0
    assert set(rep["per_tenant"]) <= set(TENANTS) | {"warmup"}


def test_hop6_gates_decide(loop):
    def judged():
        out = {}
        for v in _versions(loop):
            gates = _detail(loop, v).get("gate_results") or []
            if gates:
                out[v] = gates
        return out

    judged_versions = wait(judged, 300, "gate results", loop.home)
    for gates in judged_versions.values():
        assert {g["policy_version"] for g in gates} == {"test-loop"}
        assert {"min_eval_records", "min_tau_gain", "require_lineage", "candidate_ttl"} <= {g["name"] for g in gates}


def test_hop7_promotion_makes_a_candidate_champion(loop):
    def champion():
        champs = [v for v in _versions(loop).values() if v["state"] == "champion"]
        return champs[0] if champs else None

    v = wait(champion, 300, "a candidate to become champion", loop.home)
    assert "champion" in v["aliases"] and v["version"] in loop.candidates | set(_versions(loop))
    detail = _detail(loop, v["version"])
    assert [a for a in detail["approvals"] if a["decision"] == "approved"]  # by the policy (auto)
    assert [p for p in detail["promotions"] if p["state"] == "completed"]
    loop.champion = v["version"]


def test_hop8_node_serves_the_new_version(loop):
    assert loop.champion, "no champion"

    def served():
        n = [x for x in loop.api("GET", "/nodes").json() if x["node_id"] == "node-1"]
        v = n[0]["served_version"] if n else None
        # the champion, or a later candidate promoted after it (learning goes on)
        return n[0] if v is not None and v.isdigit() and int(v) >= int(loop.champion) else None

    node = wait(served, 120, f"the node to serve {loop.champion}", loop.home)
    assert node["status"] == "ready"
    r = httpx.post(f"{loop.ep['dataplane_url']}/v1/completions", json={"prompt": "Hello", "max_tokens": 8},
                   headers={"X-Tenant-ID": "acme"}, timeout=60)
    assert r.status_code == 200
    used = r.json()["usage"]["speculative"]["drafter_version"]
    # learning goes on: a later candidate may have been promoted since the champion was read
    assert used == loop.champion or (used in _versions(loop) and int(used) > int(loop.champion)), used
    # and the audit trail of the control plane is intact
    chain = loop.api("GET", "/audit/verify")
    assert chain.status_code == 200 and chain.json()["ok"]
