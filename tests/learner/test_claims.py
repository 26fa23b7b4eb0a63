"""Two learners, one record each: claims at the control plane (real HTTP, real broker).

Learner ``learner`` trains six records. Then ``learner-2`` reads the same log from its
start with a consumer group that has no offsets, as the group does after a broker that came
back empty, where the nodes re-sent what the broker had lost: it finishes the six as
``trained_elsewhere`` and trains only the records nobody had trained."""

from __future__ import annotations

import httpx
import pytest

from adaflash.config import load_config
from adaflash.contracts.topics import ensure_topics
from tests.dataplane.conftest import LiveServer
from tests.learner.test_service import learner_settings
from tests.learner.tiny import make_record, produce

pytestmark = pytest.mark.services


def _ledger(settings) -> list[str]:
    from learner.checkpoint import CheckpointStore
    from learner.service import state_dir

    store = CheckpointStore(state_dir(settings))
    try:
        return sorted(rid for rid, _ in store.ledger())
    finally:
        store.close()


def test_a_record_one_learner_trained_is_not_trained_by_the_other(tmp_path, broker, target_dir, drafter_dir):
    from controlplane.api import create_app
    from learner.service import Learner

    cp = load_config(home=tmp_path / "cp", controlplane={"claim_lease_s": 4.0})
    with LiveServer(create_app(cp)) as srv:
        admin = {"Authorization": f"Bearer {(cp.home / 'admin-token').read_text().strip()}"}
        keys = {}
        for lid in ("learner", "learner-2"):
            r = httpx.post(f"{srv.url}/api/v1/keys", headers=admin, timeout=10,
                           json={"name": lid, "role": "learner", "node_id": lid})
            assert r.status_code == 201, r.text
            (tmp_path / f"{lid}.key").write_text(r.json()["key"])
            keys[lid] = tmp_path / f"{lid}.key"

        first = learner_settings(tmp_path / "learner", broker, target_dir, drafter_dir, learner_id="learner",
                                 controlplane_url=srv.url, controlplane_token_file=str(keys["learner"]))
        old = [make_record(tenant=t, response=f"reply {i} from {t}.") for i, t in enumerate(["acme", "beta"] * 3)]
        ensure_topics(first.kafka.bootstrap, first.kafka, 3_600_000)
        produce(broker.bootstrap, first.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in old])
        a = Learner(first)
        a.run(exit_when_idle_s=2.0)  # closes: the trained ids are reported
        assert _ledger(first) == sorted(r.record_id for r in old)

        new = [make_record(tenant=t, response=f"later reply from {t}.") for t in ("acme", "beta")]
        produce(broker.bootstrap, first.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in new])
        # a third record "learner" claimed and died before training (its claim lapses after the lease)
        dying = make_record(tenant="acme", response="a reply whose learner died mid-step.")
        r = httpx.post(f"{srv.url}/api/v1/learners/learner/claims", timeout=10, json={"claim": [dying.record_id]},
                       headers={"Authorization": f"Bearer {keys['learner'].read_text()}"})
        assert r.json()["granted"] == [dying.record_id]
        produce(broker.bootstrap, first.kafka.feedback_topic, [(dying.tenant_id, dying.to_bytes())])
        second = learner_settings(tmp_path / "learner-2", broker, target_dir, drafter_dir, learner_id="learner-2",
                                  controlplane_url=srv.url, controlplane_token_file=str(keys["learner-2"]))
        # the same log, read from its start by a group with no offsets (as after a broker reset)
        second.kafka = first.kafka.model_copy(update={"consumer_group": first.kafka.consumer_group + "-after"})
        b = Learner(second)
        counters = b.counters
        b.run(exit_when_idle_s=2.0 + cp.controlplane.claim_lease_s)
        # none of the six trained twice; the record whose claim lapsed trained once, here
        assert _ledger(second) == sorted(r.record_id for r in new + [dying])
        assert counters["trained_elsewhere"] == len(old)
