"""An evaluation hold keeps the shadow worker from starting evaluations; lifted, the candidate
is evaluated as usual (real pieces: MLflow, the admin API over HTTP, the shadow evaluator on a
tiny target; bench/embedded_stack.py)."""

from __future__ import annotations

import time

import pytest

from bench.embedded_stack import build_stack, feedback_records, tiny_target_dir

pytestmark = pytest.mark.services


def test_a_candidate_waits_registered_while_evaluation_is_held(tmp_path, real_target_dir):
    from dataplane.tokenizer import Tokenizer

    target_dir = tiny_target_dir(tmp_path / "target", real_target_dir)
    st = build_stack(tmp_path, target_dir, feedback_records(Tokenizer(target_dir), n=12))
    try:
        held = st.admin.set_hold(False, True, "measuring the node")
        assert held.evaluation and not held.learning and held.quiet  # nothing was under evaluation
        version = st.publish(seed=1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:  # worker passes as the loops run them: discovery, rollouts, shadow
            st.workers.rollout_pass()
            assert st.workers.shadow_pass() == []
            time.sleep(0.1)
        assert st.state(version) == "registered" and st.admin.get_hold().evaluating == []
        st.admin.set_hold(False, False, "measured")
        st.drive(lambda: st.state(version) == "awaiting_approval", what="candidate evaluated once the hold lifted")
        entries = st.admin.audit(action="hold.set")
        assert [e.after["evaluation"] for e in entries] == [True, False]
    finally:
        st.close()
