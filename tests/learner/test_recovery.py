"""Kill the learner process (SIGKILL) inside and between steps, restart it: no record lost, none twice.

Each run is a real ``adaflash learner`` process against the real broker. A crash point
(ADAFLASH_LEARNER_CRASH) makes the process SIGKILL itself at an exact phase of a step:
after training but before the checkpoint, after the weights file but before the
checkpoint transaction, after the checkpoint but before the Kafka commit, and after the
commit (between steps). The last run drains the topic. The checkpoint's ledger then
holds every good record exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from adaflash.config import KafkaConfig
from adaflash.contracts.topics import ensure_topics
from learner.checkpoint import CheckpointStore
from tests.learner.tiny import TARGET_ID, committed, make_record, produce

pytestmark = pytest.mark.services
REPO = Path(__file__).resolve().parents[2]


def _run(cfg: Path, log: Path, crash: str | None, timeout: float = 120) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAFLASH_")}
    env.update(PYTHONPATH=str(REPO), MLFLOW_DISABLE_TELEMETRY="true", OMP_NUM_THREADS="1")
    if crash:
        env["ADAFLASH_LEARNER_CRASH"] = crash
    with open(log, "ab") as fh:
        fh.write(f"\n=== run crash={crash}\n".encode())
        fh.flush()
        return subprocess.run([sys.executable, "-m", "adaflash.cli", "--config", str(cfg), "learner",
                               "--exit-when-idle", "2", "--no-publish"],
                              cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode


def test_killed_learner_resumes_with_no_record_lost_and_none_trained_twice(tmp_path, broker, target_dir, drafter_dir):
    tag = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(bootstrap=broker.bootstrap, feedback_topic=f"fb-{tag}", dlq_topic=f"dlq-{tag}",
                        partitions=2, consumer_group=f"learner-{tag}")
    state = tmp_path / "state"
    cfg = tmp_path / "learner.yaml"
    cfg.write_text(yaml.safe_dump({
        "home": str(tmp_path / "home"),
        "model": {"path": str(target_dir), "target_id": TARGET_ID},
        "kafka": kafka.model_dump(),
        "learner": {"buffer_size": 4, "anchors_per_record": 2, "max_wait_s": 1.0, "init_drafter": str(drafter_dir),
                    "state_dir": str(state), "publish_every": 0, "poll_timeout_ms": 200, "max_record_tokens": 160},
    }))
    ensure_topics(kafka.bootstrap, kafka, 3_600_000)
    tenants = ["acme", "beta", "gamma"]
    good = [make_record(tenant=tenants[i % 3], response=f"answer number {i}.") for i in range(20)]
    produce(broker.bootstrap, kafka.feedback_topic, [(r.tenant_id, r.to_bytes()) for r in good] +
            [("acme", b"{broken")])
    log = tmp_path / "learner.log"

    for crash in ("after_train:1", "after_weights:2", "after_checkpoint:3", "after_commit:4"):
        rc = _run(cfg, log, crash)
        assert rc == -signal.SIGKILL, f"{crash}: exit {rc}\n{log.read_text()[-3000:]}"
        store = CheckpointStore(state)
        step = int(crash.split(":")[1])
        assert store.step == (step - 1 if crash.startswith(("after_train", "after_weights")) else step)
        store.close()
    assert _run(cfg, log, None) == 0, log.read_text()[-3000:]

    assert "already trained: skipped" in log.read_text()  # re-delivered after the kill before the Kafka commit
    store = CheckpointStore(state)
    ledger = [rid for rid, _ in store.ledger()]
    assert len(ledger) == len(set(ledger)), "a record was trained twice"
    assert set(ledger) == {r.record_id for r in good}, "a record was lost"
    # every good record and the broken one are behind the committed offsets
    assert sum(committed(broker.bootstrap, kafka.consumer_group, kafka.feedback_topic).values()) == len(good) + 1
    assert sorted(p.name for p in state.glob("weights-*.pt"))[-1] == f"weights-{store.step:08d}.pt"
