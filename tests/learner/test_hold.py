"""A learner honours the fleet's learning hold (learner/hold.py): real control plane over HTTP,
real broker. While learning is held it takes no step, keeps the records it consumed, reads the
hold between steps (so the control plane can say the hold took effect) and does not spin; once
the hold is lifted it trains them."""

from __future__ import annotations

import threading
import time

import pytest

from adaflash.config import load_config
from adaflash.contracts.topics import ensure_topics
from adaflash.controlplane_client import ControlPlaneClient
from tests.dataplane.conftest import LiveServer
from tests.learner.test_service import learner_settings
from tests.learner.tiny import make_record, produce
from tests.thread_cpu import cpu_seconds, thread_ids, thread_name

pytestmark = pytest.mark.services


def _wait(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_no_step_while_learning_is_held_and_the_records_train_once_lifted(tmp_path, broker, target_dir, drafter_dir):
    from controlplane.api import create_app
    from learner.service import Learner

    cp = load_config(home=tmp_path / "cp")
    with LiveServer(create_app(cp)) as srv:
        admin = ControlPlaneClient(srv.url, (cp.home / "admin-token").read_text().strip())
        key = admin.create_key("learner", "learner", node_id="learner").key
        (tmp_path / "learner.key").write_text(key)
        (tmp_path / "learner.key").chmod(0o600)
        admin.set_hold(True, False, "measuring")
        s = learner_settings(tmp_path / "learner", broker, target_dir, drafter_dir, learner_id="learner",
                             controlplane_url=srv.url, controlplane_token_file=str(tmp_path / "learner.key"),
                             hold_poll_s=0.2)
        records = [make_record(tenant=t, response=f"reply {i} from {t}.") for i, t in enumerate(["acme", "beta"] * 2)]
        ensure_topics(s.kafka.bootstrap, s.kafka, 3_600_000)
        produce(broker.bootstrap, s.kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in records])
        built: list[Learner] = []
        steps: list[int] = []

        def serve() -> None:  # the learner's stores belong to the thread that runs it
            built.append(Learner(s))
            steps.append(built[0].run(max_steps=1))

        before = thread_ids()  # whatever earlier work left running in this process is not the learner's
        runner = threading.Thread(target=serve, daemon=True)
        runner.start()
        _wait(lambda: built, 120, "the learner started")
        learner = built[0]
        try:
            _wait(lambda: learner.buffer.ready(), 60, "the buffer filled while held")
            mine = thread_ids() - before  # the learner's thread and every thread it started
            cpu0, t0 = cpu_seconds(mine), time.monotonic()
            time.sleep(3.0)  # buffer ready, well past max_wait_s: only the hold keeps the step back
            cpu1, dt = cpu_seconds(mine), time.monotonic() - t0
            busy = sum(cpu1.get(t, 0.0) - c for t, c in cpu0.items()) / dt
            assert runner.is_alive() and learner.hold.held and learner.hold.reason == "measuring"
            hot = {thread_name(t): round(cpu1.get(t, 0.0) - c, 2) for t, c in cpu0.items() if cpu1.get(t, 0.0) - c > 0.05}
            assert busy < 0.5, f"a held learner used {busy:.0%} of a core: {hot}"  # it waits, it does not spin
            h = admin.get_hold()
            assert h.quiet and [x.learner_id for x in h.learners] == ["learner"] and h.learners[0].quiet
            admin.set_hold(False, False, "measured")
            runner.join(120)  # one step once the hold is lifted, then run() returns
            assert steps == [1]
        finally:
            learner.stop_event.set()
            runner.join(60)
    trained = {rid for rid, _ in _ledger(s)}
    assert trained == {r.record_id for r in records}


def _ledger(settings):
    from learner.checkpoint import CheckpointStore
    from learner.service import state_dir

    store = CheckpointStore(state_dir(settings))
    try:
        return list(store.ledger())
    finally:
        store.close()


def test_an_unreachable_control_plane_keeps_the_last_hold_read(tmp_path):
    from learner.hold import HoldWatch

    cp = load_config(home=tmp_path / "cp")
    from controlplane.api import create_app

    with LiveServer(create_app(cp)) as srv:
        admin = ControlPlaneClient(srv.url, (cp.home / "admin-token").read_text().strip())
        key = admin.create_key("learner", "learner", node_id="learner").key
        admin.set_hold(True, True, "measuring")
        watch = HoldWatch(ControlPlaneClient(srv.url, key, timeout_s=2.0), "learner", interval_s=0.0)
        assert watch.maybe_tick() is True and watch.last_error is None
    # the server is gone: the hold read last stands, and the error is kept for the logs
    assert watch.maybe_tick() is True and watch.last_error
