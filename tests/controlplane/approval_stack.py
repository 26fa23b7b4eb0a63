"""A control plane with one candidate awaiting approval, for the operator CLI and console tests.

Real pieces (bench/embedded_stack.py): MLflow on SQLite, the control-plane database,
the admin API over HTTP on a random port, one serving node on a tiny target heartbeating
it, and shadow evaluation on held-out records of two tenants and two domains, so the
candidate has a report with plots per tenant and domain.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from bench.embedded_stack import Stack, build_stack, feedback_records, tiny_target_dir


@contextmanager
def candidate_awaiting_approval(root: Path, real_target_dir: Path):
    """Yields (stack, version, admin client); the version is in ``awaiting_approval``."""
    from dataplane.tokenizer import Tokenizer

    target_dir = tiny_target_dir(root / "target", real_target_dir)
    st: Stack = build_stack(root, target_dir, feedback_records(Tokenizer(target_dir), n=12))
    try:
        st.start_node("node-a", st.bundle("starter", seed=0, version="starter"))
        version = st.publish(seed=1)
        st.drive(lambda: st.state(version) == "awaiting_approval", what="candidate evaluated")
        yield st, version, st.admin
    finally:
        st.close()
