"""A drafter's whole life on real pieces, and the failures a rollout must survive.

MLflow (SQLite + local artifacts), the control-plane database, the admin API over HTTP,
and two serving nodes on a tiny target over HTTP, heartbeating the control plane; a
client keeps sending completions to the live nodes the whole time. The workers are
driven pass by pass (bench/embedded_stack.py).
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from adaflash.contracts import ALIAS_CHAMPION, ALIAS_PREVIOUS
from adaflash.contracts.manifest import Lineage
from adaflash.contracts.registry import TAG_GATES, TAG_STATE
from adaflash.controlplane_client import ControlPlaneError
from bench.embedded_stack import (
    NODE_ADMIN_TOKEN,
    Traffic,
    build_stack,
    feedback_records,
    tiny_target_dir,
)
from controlplane import lifecycle
from controlplane.db import session_scope
from controlplane.models import AuditEntry, Evaluation, Node, Promotion
from controlplane.rollout import NodePusher, RolloutReconciler
from controlplane.shadow import RecordsWindow, ShadowEvaluator
from controlplane.worker import Workers

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack(tmp_path_factory, real_target_dir):
    from dataplane.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("stack")
    target_dir = tiny_target_dir(root / "target", real_target_dir)
    records = feedback_records(Tokenizer(target_dir), n=12)
    st = build_stack(root, target_dir, records)
    starter = st.bundle("starter", seed=0, version="starter")
    st.start_node("node-a", starter)
    st.start_node("node-b", starter)
    assert st.admin.set_node_role("node-a", "canary").role == "canary"
    st.approver = st.client(st.key("approver"))
    st.viewer = st.client(st.key("viewer"))
    with Traffic(st) as traffic:
        st.traffic = traffic
        # The first drafter: evaluated against plain decoding, approved, rolled out everywhere.
        v1 = st.publish(seed=1)
        st.drive(lambda: st.state(v1) == "awaiting_approval", what="v1 evaluated")
        st.approver.approve(v1, "first")
        st.drive(lambda: st.state(v1) == "champion" and served(st) == {"node-a": v1, "node-b": v1},
                 what="v1 everywhere")
        yield st
    st.close()


def served(st) -> dict[str, str]:
    """Each node's drafter version as the node itself reports it (GET /admin/drafter)."""
    return {nid: sn.drafter()["version"] for nid, sn in sorted(st.nodes.items())}


def promote(st, seed: int, **drive) -> str:
    v = st.publish(seed=seed)
    st.drive(lambda: st.state(v) == "awaiting_approval", what=f"{v} evaluated", **drive)
    st.approver.approve(v, "looks good")
    return v


def refused(call, *args, **kw) -> int:
    """The HTTP status the control plane refused a typed client call with."""
    with pytest.raises(ControlPlaneError) as e:
        call(*args, **kw)
    return e.value.status


def audit(st, action: str) -> list[AuditEntry]:
    with st.workers.sessions() as s:
        return list(s.scalars(select(AuditEntry).where(AuditEntry.action == action).order_by(AuditEntry.seq)))


def test_lifecycle_canary_champion_and_operator_rollback(stack):
    st = stack
    v1 = lifecycle_champion(st)
    v2 = st.publish(seed=2)
    st.drive(lambda: st.state(v2) == "awaiting_approval", what="v2 evaluated")
    detail = st.version(v2)
    assert detail.state_reason.startswith("passed every gate") and all(g.passed for g in detail.gate_results)
    ev = st.admin.get_evaluation(detail.evaluation_ids[-1])
    report = ev.report
    assert report["champion_version"] == v1 and report["candidate_version"] == v2 and report["n_records"] == 12
    assert set(report["per_tenant"]) == {"acme", "globex"} and set(report["per_domain"]) == {"chat", "code"}
    assert set(ev.plots) == {"tau_per_tenant", "tau_per_domain", "reliability", "acceptance_by_position"}
    assert st.admin.plot(ev.id, "reliability")[:4] == b"\x89PNG"
    tags = st.registry.get(v2).tags
    assert tags[TAG_STATE] == "awaiting_approval" and json.loads(tags[TAG_GATES])

    # A viewer may not approve; an approver does, over the API.
    assert refused(st.viewer.approve, v2) == 403
    st.approver.approve(v2, "ok")
    seen_canary = []

    def champion_everywhere() -> bool:
        now = served(st)
        if st.state(v2) in ("canary",) and now == {"node-a": v2, "node-b": v1}:
            seen_canary.append(now)
        return st.state(v2) == "champion" and now == {"node-a": v2, "node-b": v2}

    st.drive(champion_everywhere, what="v2 champion on every node")
    assert seen_canary, "the canary node served v2 alone first"
    promo = st.admin.list_promotions()[0]
    assert promo.version == v2 and promo.state == "completed" and promo.canary_nodes == ["node-a"]
    assert st.registry.alias(ALIAS_CHAMPION) == v2 and st.registry.alias(ALIAS_PREVIOUS) == v1
    assert st.registry.get(v2).tags[TAG_STATE] == "champion"

    # Operator rollback: one call; the previous champion serves again on every node.
    assert st.approver.rollback(v2, "operator says so").kind == "rollback"
    st.drive(lambda: served(st) == {"node-a": v1, "node-b": v1} and not st.admin.list_promotions(active=True),
             what="v1 back everywhere")
    assert st.state(v1) == "champion" and st.state(v2) == "rolled_back"
    st.drive(lambda: st.registry.alias(ALIAS_CHAMPION) == v1, what="MLflow alias mirrored")
    assert st.registry.get(v2).tags[TAG_STATE] == "rolled_back"


def lifecycle_champion(st) -> str:
    with st.workers.sessions() as s:
        return lifecycle.alias(s, ALIAS_CHAMPION)


def test_corrupted_artifact_is_refused_and_audited(stack):
    st = stack
    champion = lifecycle_champion(st)
    v = st.publish(seed=3)
    store = st.registry.get(v).source.removeprefix("file://")
    with open(f"{store}/model.safetensors", "r+b") as f:
        f.seek(64)
        f.write(b"\x00\xff\x00\xff")
    st.drive(lambda: st.state(v) == "rejected", what="corrupted version refused")
    detail = st.version(v)
    assert "artifact refused" in detail.state_reason and "sha256 mismatch" in detail.state_reason
    # refused where the altered file was first seen: by discovery, which checks every file of a new
    # version, or (altered after it was discovered) by the evaluation, which checks them again
    entry = [e for e in audit(st, "version.rejected") if e.target == f"version:{v}"]
    assert entry and entry[-1].actor in ("system:discovery", "system:shadow")
    with st.workers.sessions() as s:
        evs = s.scalars(select(Evaluation).where(Evaluation.version == v)).all()
        assert (entry[-1].actor == "system:discovery") == (not evs)
        assert all(ev.status == "failed" and "sha256" in ev.error for ev in evs)
    assert refused(st.approver.approve, v) == 409
    # A node asked directly to load it refuses it too, and keeps serving.
    rv = st.registry.get(v)
    r = NodePusher(NODE_ADMIN_TOKEN)._post("node-a", st.nodes["node-a"].url, v, rv.source, detail.manifest_sha256)
    assert r.refused and "sha256" in r.error
    assert served(st) == {"node-a": champion, "node-b": champion}


def test_candidate_failing_a_gate(stack):
    st = stack
    v = st.publish(seed=4, lineage=Lineage(source="online", topic="adaflash.feedback.v1"))
    st.drive(lambda: st.state(v) == "gate_failed", what="gate failure")
    detail = st.version(v)
    failed = {g.name for g in detail.gate_results if not g.passed}
    assert "require_lineage" in failed and "require_lineage" in detail.state_reason
    assert refused(st.approver.approve, v) == 409
    assert json.loads(st.registry.get(v).tags[TAG_GATES])


def test_node_down_during_rollout_converges_when_back(stack):
    st = stack
    st.stop_node("node-b")  # down: no heartbeats, no HTTP
    v = promote(st, seed=5)
    st.drive(lambda: st.state(v) == "champion", what="rollout proceeds without the silent node")
    assert served(st) == {"node-a": v}
    with st.workers.sessions() as s:
        assert s.get(Node, "node-b").desired_version == v
    st.start_node("node-b", st.bundles / "starter")  # comes back with its starter drafter
    st.drive(lambda: served(st) == {"node-a": v, "node-b": v}, what="node-b converged")


def test_control_plane_killed_mid_rollout_resumes(stack):
    st = stack
    v = promote(st, seed=6)
    st.drive(lambda: st.admin.list_promotions(active=True)[0].state in ("canary", "watching"),
             what="promotion under way", shadow=False)
    # And a second candidate whose evaluation the crash interrupts.
    w = st.publish(seed=7)
    st.workers.discover()
    with session_scope(st.workers.sessions) as s:
        lifecycle.start_evaluation(s, w, actor="system:shadow")
    # The old workers die here; new ones start from the database alone.
    sessions = st.workers.sessions
    evaluator = ShadowEvaluator(st.settings, sessions, st.registry, st.workers.policy,
                                RecordsWindow(st.workers.evaluator.window._records), target=st.target,
                                tokenizer=st.tokenizer, target_identity=st.identity, retry_s=1.0)
    reconciler = RolloutReconciler(sessions, st.workers.policy, st.settings, registry=st.registry,
                                   pusher=NodePusher(NODE_ADMIN_TOKEN, retry_s=1.0))
    fresh = Workers(st.settings, sessions, st.workers.policy, registry=st.registry, evaluator=evaluator,
                    reconciler=reconciler)
    assert evaluator.recover() == [w]
    st.workers = fresh
    st.drive(lambda: st.state(v) == "champion" and served(st) == {"node-a": v, "node-b": v}
             and st.state(w) == "awaiting_approval", what="rollout finished after restart")
    resumed = [e for e in audit(st, "promotion.resume") if e.after["lease_owner"] == reconciler.owner]
    assert resumed
    with sessions() as s:
        p = s.scalars(select(Promotion).where(Promotion.version == v)).one()
        assert p.state == "completed" and p.attempts >= 1
    st.approver.reject(w, "not needed")


def test_live_regression_after_promotion_rolls_back(stack):
    st = stack
    with st.workers.sessions() as s:
        champion, previous = lifecycle.alias(s, ALIAS_CHAMPION), lifecycle.alias(s, ALIAS_PREVIOUS)
        baseline = s.scalars(select(Promotion).where(Promotion.version == champion)).one().baseline
    assert baseline["tau"] and previous
    for sn in st.nodes.values():
        node = sn.node
        real = node.live_status
        node.live_status = lambda real=real: {**real(), "tau": 0.3, "tps": 5.0}
    try:
        st.drive(lambda: served(st) == {"node-a": previous, "node-b": previous}
                 and not st.admin.list_promotions(active=True), what="automatic rollback")
    finally:
        for sn in st.nodes.values():
            del sn.node.live_status
    assert st.state(champion) == "rolled_back" and st.state(previous) == "champion"
    detail = st.version(champion)
    assert detail.state_reason.startswith("live regression after promotion") and "tau" in detail.state_reason
    entry = [e for e in audit(st, "version.rolled_back") if e.target == f"version:{champion}"][-1]
    assert entry.actor == "system:rollout"


def test_users_were_served_throughout(stack):
    assert stack.traffic.ok > 50
    assert stack.traffic.failures == []
