"""pack_drafts: the Triton kernel and the torch reference against a plain loop."""

from __future__ import annotations

import pytest
import torch

from dataplane import kernels
from dataplane.kernels import (
    draft_prob_rows,
    pack_draft_probs,
    pack_drafts,
    pack_drafts_torch,
    pack_drafts_triton,
)
from tests.dataplane.kernels.helpers import gen, random_k_hat, requires_triton, to_device


def pack_naive(last_tokens, drafts, k_hat, seq_lens):
    tokens, positions, cu = [], [], [0]
    for b in range(k_hat.numel()):
        k = int(k_hat[b])
        tokens += [int(last_tokens[b])] + drafts[b, : k - 1].tolist()
        positions += [int(seq_lens[b]) + i for i in range(k)]
        cu.append(cu[-1] + k)
    return torch.tensor(tokens), torch.tensor(positions), torch.tensor(cu)


def random_inputs(num_reqs: int, max_k: int, seed: int, k_hat: torch.Tensor | None = None):
    g = gen(seed)
    last_tokens = torch.randint(0, 50_000, (num_reqs,), generator=g)
    drafts = torch.randint(0, 50_000, (num_reqs, max_k - 1), generator=g)
    if k_hat is None:
        k_hat = random_k_hat(num_reqs, max_k, g)
    seq_lens = torch.randint(0, 4096, (num_reqs,), generator=g)
    return last_tokens, drafts, k_hat, seq_lens


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("max_k", [1, 16, 40])
def test_reference_matches_loop(num_reqs, max_k):
    inputs = random_inputs(num_reqs, max_k, seed=num_reqs * 100 + max_k)
    assert_same(pack_drafts_torch(*inputs), pack_naive(*inputs))


@requires_triton
@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("max_k", [1, 16, 40])
def test_triton_matches_reference(num_reqs, max_k):
    # max_k = 40 spans two loop steps of the kernel; max_k = 1 has no draft columns at all.
    inputs = to_device(*random_inputs(num_reqs, max_k, seed=num_reqs * 100 + max_k + 1))
    assert_same(pack_drafts_triton(*inputs), pack_drafts_torch(*inputs))


@requires_triton
@pytest.mark.parametrize("k", [1, 16])
def test_uniform_lengths(k):
    num_reqs = 8
    k_hat = torch.full((num_reqs,), k, dtype=torch.int64)
    inputs = random_inputs(num_reqs, 16, seed=k, k_hat=k_hat)
    want = pack_naive(*inputs)
    assert_same(pack_drafts_torch(*inputs), want)
    assert_same(pack_drafts_triton(*to_device(*inputs)), want)
    assert want[2].tolist() == [k * b for b in range(num_reqs + 1)]


def test_num_tokens_hint_matches():
    inputs = random_inputs(5, 8, seed=3)
    T = int(inputs[2].sum())
    assert_same(pack_drafts_torch(*inputs, num_tokens=T), pack_drafts_torch(*inputs))


def test_draft_prob_rows_and_packing():
    num_reqs, max_k, vocab = 6, 5, 11
    last_tokens, drafts, k_hat, seq_lens = random_inputs(num_reqs, max_k, seed=7)
    g = gen(8)
    draft_probs = torch.rand(num_reqs, max_k - 1, vocab, generator=g)
    _, _, cu = pack_drafts_torch(last_tokens, drafts, k_hat, seq_lens)
    rows = draft_prob_rows(cu, max_k - 1)
    packed = pack_draft_probs(draft_probs, cu)
    for b in range(num_reqs):
        s, e = int(cu[b]), int(cu[b + 1])
        for i in range(e - s - 1):
            assert int(rows[s + i]) == b * (max_k - 1) + i
            assert torch.equal(packed[s + i], draft_probs[b, i])
        assert int(rows[e - 1]) == -1
        assert torch.count_nonzero(packed[e - 1]) == 0


def test_pack_draft_probs_without_draft_columns():
    cu = torch.tensor([0, 1, 2])
    packed = pack_draft_probs(torch.zeros(2, 0, 9), cu)
    assert packed.shape == (2, 9)


@requires_triton
def test_dispatcher_uses_triton_when_forced(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return pack_drafts_triton(*args, **kwargs)

    monkeypatch.setattr(kernels, "pack_drafts_triton", spy)
    inputs = random_inputs(4, 6, seed=11)
    monkeypatch.setenv(kernels.FORCE_TRITON_ENV, "1")
    assert_same(pack_drafts(*inputs), pack_naive(*inputs))
    assert calls == [1]
    monkeypatch.setenv(kernels.FORCE_TRITON_ENV, "0")
    pack_drafts(*inputs)
    assert calls == [1]  # CPU inputs without the override take the torch path
