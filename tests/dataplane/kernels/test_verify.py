"""dataplane.verify: logits processing and the verification entry points."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import greedy_accept_torch, pack_draft_probs, pack_drafts
from dataplane.verify import (
    VerifyResult,
    process_logits,
    sample_draft_tokens,
    top_p_filter,
    verify,
    verify_greedy,
    verify_sampling,
)
from tests.dataplane.kernels.helpers import gen


def test_process_logits_temperature_one_is_softmax():
    logits = torch.randn(3, 5, 17, generator=gen(0))
    torch.testing.assert_close(process_logits(logits, 1.0, 1.0), torch.softmax(logits, dim=-1))


def test_process_logits_per_row_temperature():
    logits = torch.randn(4, 9, generator=gen(1))
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.0])
    want = torch.softmax(logits / temperature[:, None], dim=-1)
    torch.testing.assert_close(process_logits(logits, temperature, torch.ones(4)), want)


def test_process_logits_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 0.0, 2.0]])
    probs = process_logits(logits, torch.zeros(2), torch.full((2,), 0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    top_p = torch.tensor([0.8, 0.81, 0.1, 1.0])
    out = top_p_filter(probs, top_p)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(out[1], torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95)
    torch.testing.assert_close(out[2], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # the top token always stays
    torch.testing.assert_close(out[3], probs[3])


def test_top_p_ties_cut_by_lowest_id():
    probs = torch.full((1, 4), 0.25)
    assert top_p_filter(probs, torch.tensor([0.5])).tolist() == [[0.5, 0.5, 0.0, 0.0]]


def test_process_logits_broadcasts_request_params_over_blocks():
    logits = torch.randn(2, 3, 11, generator=gen(2))  # [B, K-1, V]
    temperature = torch.tensor([0.5, 2.0])
    top_p = torch.tensor([0.9, 1.0])
    probs = process_logits(logits, temperature[:, None], top_p[:, None])
    for b in range(2):
        torch.testing.assert_close(probs[b], process_logits(logits[b], temperature[b], top_p[b]))


def test_sample_draft_tokens_respects_support():
    probs = torch.zeros(8, 3, 20)
    probs[..., 4] = 0.5
    probs[..., 17] = 0.5
    tokens = sample_draft_tokens(probs, gen(3))
    assert tokens.shape == (8, 3)
    assert set(tokens.unique().tolist()) <= {4, 17}


def make_batch(k_hat: list[int], vocab: int, seed: int):
    """A packed stream with drafts sampled from a drafter close to the target."""
    g = gen(seed)
    num_reqs, max_k = len(k_hat), max(k_hat)
    k_hat_t = torch.tensor(k_hat)
    target_block = torch.randn(num_reqs, max_k, vocab, generator=g) * 3
    draft_logits = target_block[:, :-1] + 0.3 * torch.randn(num_reqs, max_k - 1, vocab, generator=g)
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.0, 1.2][:num_reqs])
    top_p = torch.tensor([1.0, 0.95, 1.0, 0.9, 0.8][:num_reqs])
    draft_probs = process_logits(draft_logits, temperature[:, None], top_p[:, None])
    drafts = sample_draft_tokens(draft_probs, g)
    last = torch.randint(0, vocab, (num_reqs,), generator=g)
    token_ids, _, cu = pack_drafts(last, drafts, k_hat_t, torch.zeros(num_reqs, dtype=torch.int64))
    rows = torch.cat([target_block[b, :k] for b, k in enumerate(k_hat)])  # [T, V]
    return rows, token_ids, cu, temperature, top_p, pack_draft_probs(draft_probs, cu)


def test_verify_greedy_is_greedy_accept():
    logits, token_ids, cu, *_ = make_batch([4, 2, 5, 1, 3], vocab=50, seed=4)
    result = verify_greedy(logits, token_ids, cu)
    want = greedy_accept_torch(logits, token_ids, cu)
    assert torch.equal(result.accepted, want[0]) and torch.equal(result.bonus, want[1])


def test_sampling_at_temperature_zero_equals_greedy():
    # One-hot target rows make rejection sampling accept exactly the argmax prefix.
    logits, token_ids, cu, _, top_p, draft_probs = make_batch([4, 2, 5, 1, 3], vocab=50, seed=5)
    sampled = verify_sampling(logits, draft_probs, token_ids, cu, torch.zeros(5), top_p, gen(0))
    greedy = verify_greedy(logits, token_ids, cu)
    assert torch.equal(sampled.accepted, greedy.accepted) and torch.equal(sampled.bonus, greedy.bonus)


def test_mixed_batch_splits_greedy_and_sampled():
    logits, token_ids, cu, temperature, top_p, draft_probs = make_batch([4, 6, 5, 3, 6], vocab=50, seed=6)
    greedy_rows = torch.repeat_interleave(temperature == 0, cu.diff())
    draft_probs[greedy_rows] = float("nan")  # greedy requests never read their draft rows
    mixed = verify(logits, token_ids, cu, temperature, top_p, draft_probs, gen(7))
    greedy = verify_greedy(logits, token_ids, cu)
    sampled = verify_sampling(logits, draft_probs, token_ids, cu, temperature, top_p, gen(7))
    is_greedy = temperature == 0
    assert torch.equal(mixed.accepted[is_greedy], greedy.accepted[is_greedy])
    assert torch.equal(mixed.bonus[is_greedy], greedy.bonus[is_greedy])
    assert torch.equal(mixed.accepted[~is_greedy], sampled.accepted[~is_greedy])
    assert torch.equal(mixed.bonus[~is_greedy], sampled.bonus[~is_greedy])
    assert (mixed.accepted <= cu.diff() - 1).all()


def test_verify_is_reproducible_with_a_seeded_generator():
    logits, token_ids, cu, temperature, top_p, draft_probs = make_batch([6, 6, 6, 6, 6], vocab=40, seed=8)
    temperature = torch.ones(5)
    first = verify(logits, token_ids, cu, temperature, top_p, draft_probs, gen(9))
    second = verify(logits, token_ids, cu, temperature, top_p, draft_probs, gen(9))
    assert torch.equal(first.accepted, second.accepted) and torch.equal(first.bonus, second.bonus)


def test_all_greedy_needs_no_draft_probs_but_sampling_does():
    logits, token_ids, cu, *_ = make_batch([3, 2], vocab=30, seed=10)
    result = verify(logits, token_ids, cu, torch.zeros(2))
    assert torch.equal(result.accepted, verify_greedy(logits, token_ids, cu).accepted)
    with pytest.raises(ValueError):
        verify(logits, token_ids, cu, torch.tensor([0.0, 1.0]))


def test_emitted_tokens():
    token_ids = torch.tensor([10, 11, 12, 20, 30, 31])
    cu = torch.tensor([0, 3, 4, 6])
    result = VerifyResult(accepted=torch.tensor([2, 0, 0]), bonus=torch.tensor([13, 21, 32]))
    assert result.emitted_tokens(token_ids, cu) == [[11, 12, 13], [21], [32]]
    assert result.num_emitted.tolist() == [3, 1, 1]
