"""The cost-aware verified length: expected tokens per unit of measured step time."""

from __future__ import annotations

import pytest

from dataplane.cost_model import CostModel


def _model(base: float, per_request: float, per_token: float, draft: float = 0.0) -> CostModel:
    c = CostModel(base_s=base, per_request_s=per_request, per_token_s=per_token, draft_per_request_s=draft)
    return c


def _brute(c: CostModel, p: float, cap: int, batch: int) -> int:
    base, per_req, per_tok = c.coef
    share = base / batch + per_req + per_tok
    rates = [sum(p ** i for i in range(m)) / (1 + per_tok * (m - 1) / share) for m in range(1, cap + 1)]
    return 1 + max(range(cap), key=lambda i: (rates[i], -i))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_best_length_is_the_argmax_of_tokens_per_time(p, batch):
    c = _model(0.08, 0.004, 0.0025)
    m, _ = c.best_length(p, 16, batch)
    assert m == _brute(c, p, 16, batch)


def test_cheap_verify_tokens_make_a_weak_drafter_worth_one_draft():
    """Memory-bound node (a verify token costs ~1% of a step): p = 0.25 pays for a short block,
    where the paper's floor(gamma * a_hat * k) with a_hat = E / (k - 1) rounds to plain decoding."""
    c = _model(0.2, 0.001, 0.002)
    p = 0.25
    m, gain = c.best_length(p, 16, 1)
    assert m >= 2 and gain > 1.0
    a_hat = CostModel.expected_accepted(p, 15) / 15
    assert int(a_hat * 16) <= 1


def test_compute_bound_node_falls_back_to_plain_decoding():
    """Busy node (per-token time dominates a request's share): a weak drafter never pays."""
    c = _model(0.01, 0.0, 0.01, draft=0.002)
    m, gain = c.best_length(0.25, 16, 64)
    assert m == 1 and gain < 1.0


def test_strong_drafter_on_idle_node_verifies_the_whole_block():
    c = _model(0.2, 0.001, 0.002)
    assert c.best_length(0.95, 16, 1)[0] == 16
    assert c.best_length(0.95, 5, 1)[0] == 5  # never past the request's cap


def test_position_accept_inverts_the_expected_accepted_count():
    for a in (0.01, 0.05, 0.2, 0.5, 0.9):
        p = CostModel.position_accept(a, 16)
        assert CostModel.expected_accepted(p, 15) == pytest.approx(15 * a, rel=1e-6)
        assert sum(p ** i for i in range(1, 16)) == pytest.approx(15 * a, rel=1e-6)
    assert CostModel.position_accept(1.0, 16) == 0.995
    assert CostModel.position_accept(0.0, 16) == 0.0
