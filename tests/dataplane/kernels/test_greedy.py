"""greedy_accept: the Triton kernels and the torch reference against a plain loop."""

from __future__ import annotations

import pytest
import torch

from dataplane import kernels
from dataplane.kernels import greedy_accept, greedy_accept_torch, greedy_accept_triton
from dataplane.kernels.greedy import row_argmax_triton
from tests.dataplane.kernels.helpers import (
    gen,
    random_k_hat,
    requires_triton,
    segments,
    stream_layout,
    to_device,
)


def greedy_naive(logits, token_ids, cu_seqlens):
    accepted, bonus = [], []
    for s, e in segments(cu_seqlens):
        n = 0
        while n < e - s - 1 and int(token_ids[s + 1 + n]) == int(logits[s + n].argmax()):
            n += 1
        accepted.append(n)
        bonus.append(int(logits[s + n].argmax()))
    return torch.tensor(accepted), torch.tensor(bonus)


def make_case(k_hat: torch.Tensor, vocab: int, seed: int, match_rate: float = 0.8, ties: bool = False):
    """Random logits and a stream whose drafts copy the target argmax with ``match_rate``."""
    g = gen(seed)
    cu, T = stream_layout(k_hat)
    if ties:
        # Few distinct values: every row has many tied maxima.
        logits = torch.randint(0, 3, (T, vocab), generator=g).float()
    else:
        logits = torch.randn(T, vocab, generator=g)
    argmax = logits.argmax(dim=-1)
    token_ids = torch.randint(0, vocab, (T,), generator=g)
    copy = torch.rand(T, generator=g) < match_rate
    token_ids[1:] = torch.where(copy[1:], argmax[:-1], token_ids[1:])
    return logits, token_ids, cu


def check(logits, token_ids, cu, triton: bool = True):
    want = greedy_naive(logits, token_ids, cu)
    ref = greedy_accept_torch(logits, token_ids, cu)
    assert all(torch.equal(r, w) for r, w in zip(ref, want, strict=True))
    if triton:
        got = greedy_accept_triton(*to_device(logits, token_ids, cu))
        assert all(torch.equal(x.cpu(), w) for x, w in zip(got, want, strict=True))
    return want


@requires_triton
@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_streams(num_reqs, seed):
    k_hat = random_k_hat(num_reqs, 16, gen(seed))
    accepted, _ = check(*make_case(k_hat, vocab=1000, seed=seed))
    if num_reqs == 64:
        assert 0 < accepted.sum() < (k_hat - 1).sum()  # a real mix of lengths


@requires_triton
def test_large_vocab_not_power_of_two():
    k_hat = torch.tensor([3, 1, 5])
    check(*make_case(k_hat, vocab=49152, seed=2))


@requires_triton
@pytest.mark.parametrize("vocab", [7, 1000, 2049])
def test_ties_take_lowest_index(vocab):
    k_hat = random_k_hat(16, 6, gen(vocab))
    logits, token_ids, cu = make_case(k_hat, vocab=vocab, seed=vocab, ties=True)
    assert torch.equal(row_argmax_triton(logits.to(token_ids.device)).cpu(), logits.argmax(dim=-1))
    check(logits, token_ids, cu)


@requires_triton
def test_tie_across_vocab_blocks():
    # The same maximum in the first and the last vocabulary block: the first must win.
    logits = torch.zeros(2, 3000)
    logits[0, [5, 2999]] = 4.0
    logits[1, [1500, 2048]] = 4.0
    assert row_argmax_triton(logits).tolist() == [5, 1500]


@requires_triton
def test_half_precision_and_infinite_logits():
    k_hat = torch.tensor([4, 2, 3])
    logits, token_ids, cu = make_case(k_hat, vocab=300, seed=5)
    logits[1] = float("-inf")  # a fully masked row argmaxes to 0, as in torch
    logits[2, :150] = float("-inf")
    check(logits.half(), token_ids, cu)


@requires_triton
def test_all_accepted():
    k_hat = torch.tensor([1, 16, 7, 2])
    logits, token_ids, cu = make_case(k_hat, vocab=1000, seed=6, match_rate=1.0)
    accepted, bonus = check(logits, token_ids, cu)
    assert torch.equal(accepted, k_hat - 1)
    assert torch.equal(bonus, logits[cu[1:] - 1].argmax(dim=-1))


@requires_triton
def test_first_draft_rejected():
    k_hat = torch.tensor([5, 3, 16])
    logits, token_ids, cu = make_case(k_hat, vocab=1000, seed=7, match_rate=1.0)
    starts = cu[:-1]
    token_ids[starts + 1] = (logits[starts].argmax(dim=-1) + 1) % 1000
    accepted, bonus = check(logits, token_ids, cu)
    assert accepted.tolist() == [0, 0, 0]
    assert torch.equal(bonus, logits[starts].argmax(dim=-1))


@requires_triton
def test_no_drafts():
    k_hat = torch.ones(64, dtype=torch.int64)
    logits, token_ids, cu = make_case(k_hat, vocab=1000, seed=8)
    accepted, bonus = check(logits, token_ids, cu)
    assert accepted.sum() == 0
    assert torch.equal(bonus, logits.argmax(dim=-1))


@requires_triton
def test_dispatcher_forced(monkeypatch):
    logits, token_ids, cu = make_case(torch.tensor([3, 4]), vocab=100, seed=9)
    monkeypatch.setenv(kernels.FORCE_TRITON_ENV, "1")
    got = greedy_accept(logits, token_ids, cu)
    want = greedy_naive(logits, token_ids, cu)
    assert all(torch.equal(x, w) for x, w in zip(got, want, strict=True))
