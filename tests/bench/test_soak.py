"""The soak, three minutes of it, in the suite: ``adaflash bench soak`` on the fleet of two
nodes and two learners (real broker, MLflow, control plane, Presidio scrubbers), mixed
traffic from three tenants plus a flooding one, every fault injected once, and every
invariant must hold (the command exits non-zero when one does not).

The broker kill empties the embedded broker (its log is in memory, and the group's offsets
with it). What it had acknowledged and no learner had read yet is sent again by the nodes'
producers (they see the feedback topic's new id); a record one learner had trained that
reaches the other learner in the new log is refused to it by the record claims at the
control plane (``trained_elsewhere``), so none is lost and none is trained twice.

The nodes serve a tiny target that shares the real tokenizer, so that three minutes on
two shared cores carry enough requests, and the control plane runs a lenient gate policy
with automatic approval: candidates from the learners are promoted during the run, so
the operator rollback fault finds a champion with a previous one, or a canary in flight,
to roll back, and is injected, not skipped. ``adaflash bench soak`` with the real model and the shipped gate policy is the
30-minute run of the README.
"""

from __future__ import annotations

import json

import pytest

from tests.stack.conftest import adaflash, loop_env, tiny_bundle, tiny_vocab_target  # noqa: F401 - fixtures
from tests.stack.test_closed_loop import POLICY

pytestmark = pytest.mark.services

# the control plane first: killed later, it interrupts the first evaluations and the promotions
# the rollback needs come too late in three minutes
FAULTS = "controlplane,corrupt,broker,learner,node,scrubber,rollback"


@pytest.mark.timeout(1500)
def test_three_minute_soak_with_faults_keeps_every_invariant(tmp_path, tiny_vocab_target, tiny_bundle):  # noqa: F811
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "soak"
    # larger learner steps, a candidate every fourth: a few promotions in three minutes, not hundreds;
    # shadow evaluation replays a small window, so that it keeps up on two busy cores
    env = loop_env(out / "home", tiny_vocab_target, tiny_bundle, policy, ADAFLASH_LEARNER__BUFFER_SIZE="32",
                   ADAFLASH_LEARNER__PUBLISH_EVERY="4", ADAFLASH_CONTROLPLANE__SHADOW_MAX_RECORDS="16",
                   ADAFLASH_CONTROLPLANE__CLAIM_LEASE_S="20",  # steps of a tiny model take a few seconds
                   # the tiny nodes serve faster than two learners train beside them on two cores: a
                   # record a learner reaches over a minute late is shed and counted, as in production
                   ADAFLASH_LEARNER__MAX_RECORD_AGE_S="60")
    r = adaflash(env, "bench", "soak", "--minutes", "3", "--concurrency", "4", "--tenants", "3",
                 "--faults", FAULTS, "--out", str(out), timeout=1400, check=False)
    res = json.loads((out / "result.json").read_text())
    inv = res["invariants"]
    failed = {k: v for k, v in inv.items() if not v["held"]}
    assert not failed, json.dumps(failed, indent=1, default=str)[:6000]
    assert r.returncode == 0, r.stderr[-3000:]
    faults = {f["name"]: f for f in res["faults"]}
    assert set(faults) == set(FAULTS.split(",")) and all(f["ok"] for f in faults.values()), res["faults"]
    # each killed part came back within the run; the rollback undid a promotion made during it
    assert all(faults[p]["recovered_s"] is not None for p in ("broker", "learner", "controlplane", "node"))
    assert faults["rollback"]["detail"].startswith("rollback of ")
    assert inv["well_formed_requests_served"]["requests"] >= 30
    assert inv["flood_is_isolated"]["flood_429"] > 0
    assert inv["records_accounted"]["held"] and inv["no_record_trained_twice"]["held"]
    assert inv["learners_caught_up"]["held"]
    assert (out / "timeline.png").stat().st_size > 0
