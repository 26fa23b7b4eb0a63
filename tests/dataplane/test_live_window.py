"""The node's live window (what the control plane judges canaries by) restarts at a drafter swap."""

from __future__ import annotations

from dataplane.metrics import NodeMetrics


def test_live_window_holds_only_the_serving_version():
    m = NodeMetrics()
    m.set_drafter("v1")
    m.on_tokens(40, rounds=10)
    assert m.live()["tau"] == 4.0 and m.live()["tps"] > 0
    m.set_drafter("v1")  # the same version again: nothing changes
    assert m.live()["tau"] == 4.0
    m.set_drafter("v2")
    assert m.live() == {"tps": 0.0, "tau": 0.0}
    m.on_tokens(6, rounds=6)
    assert m.live()["tau"] == 1.0
