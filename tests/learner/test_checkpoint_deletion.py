"""Deleting a tenant from the checkpoint store: ids leave the file, de-duplication stays exact."""

from __future__ import annotations

from datetime import UTC, datetime

from learner.checkpoint import CheckpointStore, Done, hashed_id


def test_purge_hashes_ids_keeps_dedup_and_survives_restart(tmp_path):
    store = CheckpointStore(tmp_path)
    done = [Done("gone-rec-1", "gone", "trained"), Done("gone-rec-2", "gone", "expired"),
            Done("stay-rec-1", "stay", "trained")]
    store.commit(1, "weights-00000001.pt", done, "t", {0: 3})
    before = datetime(2026, 3, 1, tzinfo=UTC)
    assert store.purge_tenant("gone", before) == {"ledger": 1, "seen": 2}
    assert store.purge_tenant("gone", before) == {"ledger": 0, "seen": 0}  # twice: nothing more
    assert store.ledger() == [(hashed_id("gone-rec-1"), 1), ("stay-rec-1", 1)]
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("state.db*"))
    assert b"gone-rec-" not in raw and b"stay-rec-1" in raw
    again = CheckpointStore(tmp_path)
    assert all(again.seen(r) for r in ("gone-rec-1", "gone-rec-2", "stay-rec-1")) and not again.seen("new")
    assert again.deleted_before() == {"gone": before}
    again.close()
