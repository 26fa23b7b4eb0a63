"""The cost-aware verified length: expected tokens per unit of measured step time."""

from __future__ import annotations

import pytest

from dataplane import spec_policy as sp
from dataplane.cost_model import CostModel


def _model(base: float, per_request: float, per_token: float, draft: float = 0.0) -> CostModel:
    return CostModel(base_s=base, per_request_s=per_request, per_token_s=per_token, draft_per_request_s=draft)


def _brute(c: CostModel, p: float, cap: int, batch: int) -> int:
    base, per_req, per_tok = c.coef
    share = base / batch + per_req + per_tok
    rates = [sum(p ** i for i in range(m)) / (1 + per_tok * (m - 1) / share) for m in range(1, cap + 1)]
    return 1 + max(range(cap), key=lambda i: (rates[i], -i))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_best_length_is_the_argmax_of_tokens_per_time(p, batch):
    c = _model(0.08, 0.004, 0.0025)
    m, _ = sp.best_length(c, p, 16, batch)
    assert m == _brute(c, p, 16, batch)


def test_cheap_verify_tokens_make_a_weak_drafter_worth_one_draft():
    """Memory-bound node (a verify token costs ~1% of a step): p = 0.25 pays for a short block,
    where the paper's floor(gamma * a_hat * k) with a_hat = E / (k - 1) rounds to plain decoding."""
    c = _model(0.2, 0.001, 0.002)
    p = 0.25
    m, gain = sp.best_length(c, p, 16, 1)
    assert m >= 2 and gain > 1.0
    a_hat = sp.expected_accepted(p, 15) / 15
    assert sp.paper_k_hat(a_hat, 16, 1.0) <= 1


def test_compute_bound_node_falls_back_to_plain_decoding():
    """Busy node (per-token time dominates a request's share): a weak drafter never pays."""
    c = _model(0.01, 0.0, 0.01, draft=0.002)
    m, gain = sp.best_length(c, 0.25, 16, 64)
    assert m == 1 and gain < 1.0


def test_strong_drafter_on_idle_node_verifies_the_whole_block():
    c = _model(0.2, 0.001, 0.002)
    assert sp.best_length(c, 0.95, 16, 1)[0] == 16
    assert sp.best_length(c, 0.95, 5, 1)[0] == 5  # never past the request's cap


def test_position_accept_inverts_the_expected_accepted_count():
    for a in (0.01, 0.05, 0.2, 0.5, 0.9):
        p = sp.position_accept(a, 16)
        assert sp.expected_accepted(p, 15) == pytest.approx(15 * a, rel=1e-6)
        assert sum(p ** i for i in range(1, 16)) == pytest.approx(15 * a, rel=1e-6)
    assert sp.position_accept(1.0, 16) == sp.CONSTANTS.head_p_max
    assert sp.position_accept(0.0, 16) == 0.0


def test_calibration_corrects_an_overconfident_head_within_a_few_steps_and_resets_at_a_swap():
    cfg = sp.PolicyConfig(block_size=16)
    node = sp.NodeState()
    for _ in range(3):  # the head says 0.6; nothing is ever accepted
        sp.calibrate(node, [(8, 0.6, 0), (8, 0.6, 0)], cfg)
    assert node.calib <= cfg.consts.calib_floor + 1e-9  # the plain 0.05-EMA would still be above 0.85
    node.reset()
    assert node.calib == 1.0 and node.calib_rounds == 0
    for _ in range(40):  # the head is right: calibration stays at 1
        pred = sp.expected_accepted(sp.position_accept(0.6, 16), 7)
        sp.calibrate(node, [(8, 0.6, round(pred))] * 2, cfg)
    assert 0.8 < node.calib < 1.25


def test_node_backs_off_the_drafter_when_no_request_would_verify_a_draft(tiny_target):
    """A drafter whose passes never pay (its time dwarfs a verify step), with requests
    arriving all the time (each new one would try drafting): the node runs it on far
    fewer steps than per-request back-off alone does; outputs are those of ar."""
    from dataplane.drafter import new_drafter
    from tests.dataplane.engine_util import make_engine, prompts, run

    d = new_drafter(tiny_target, seed=1, num_layers=1, n_target_layers=2, block_size=8, head_hidden=16)
    ps = prompts(24, 97, seed=3)
    calls = []
    orig = d.forward_block
    d.forward_block = lambda *a, **kw: calls.append(1) or orig(*a, **kw)

    def serve(node_backoff: bool):
        calls.clear()
        eng = make_engine(tiny_target, drafter=d, max_running=4)
        eng.cost.draft_per_request_s = 10.0
        eng.cost.observe_draft = lambda batch, seconds: None  # keep the drafter's cost pinned
        eng.step_runner.node.calib_rounds = sp.CONSTANTS.warmup_rounds  # past the new drafter's probation
        if not node_backoff:
            eng.step_runner.node.backoff = 0  # node-wide skips stay at zero
        return [s.output_ids for s in run(eng, ps, max_tokens=12)], len(calls)

    with_out, with_calls = serve(True)
    without_out, without_calls = serve(False)
    ar = [s.output_ids for s in run(make_engine(tiny_target, mode="ar", max_running=4), ps, max_tokens=12)]
    assert with_out == without_out == ar
    assert 0 < with_calls and with_calls * 2 <= without_calls
