"""Rejection sampling is lossless: emitted tokens follow the target distribution.

Each draw is one request with a single draft (k_hat = 2), all draws verified in one
vectorised call. The first emitted token is the draft when accepted, else the bonus; its
empirical distribution must match p (chi-square), even with a drafter q far from p. The
same test must catch a sampler whose residual is wrong.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dataplane.kernels import cu_seqlens_from_lengths, rejection_accept_torch, rejection_accept_triton
from dataplane.kernels.rejection import sample_inverse_cdf
from dataplane.verify import process_logits, verify_sampling
from tests.dataplane.kernels.helpers import gen, requires_triton, to_device

NUM_DRAWS = 200_000
ALPHA = 0.01

# Target after the committed token, a poor drafter (includes a token p wants but q never
# proposes, and mass on a token p never produces), and the target one step later.
P_FIRST = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03, 0.00])
Q_FIRST = torch.tensor([0.05, 0.10, 0.00, 0.15, 0.30, 0.25, 0.15])
P_NEXT = torch.tensor([0.05, 0.05, 0.10, 0.10, 0.20, 0.20, 0.30])

IMPLS = [pytest.param(rejection_accept_torch, id="torch")]
if torch.cuda.is_available():
    # 200k programs are too many for the CPU interpreter; on a GPU the kernel is checked too.
    IMPLS.append(pytest.param(rejection_accept_triton, id="triton"))


def single_draft_batch(seed: int):
    """NUM_DRAWS requests, each [committed token, one draft ~ Q_FIRST]."""
    g = gen(seed)
    n, vocab = NUM_DRAWS, P_FIRST.numel()
    drafts = torch.multinomial(Q_FIRST.expand(n, vocab), 1, replacement=True, generator=g).squeeze(1)
    token_ids = torch.stack([torch.zeros(n, dtype=torch.int64), drafts], dim=1).reshape(-1)
    cu = cu_seqlens_from_lengths(torch.full((n,), 2, dtype=torch.int64))
    target = torch.stack([P_FIRST, P_NEXT]).repeat(n, 1)  # [2n, V]
    draft = torch.stack([Q_FIRST, torch.zeros_like(Q_FIRST)]).repeat(n, 1)
    uniforms = torch.rand(2 * n, generator=g)
    bonus_uniforms = torch.rand(n, generator=g)
    return target, draft, token_ids, cu, uniforms, bonus_uniforms, drafts


def p_value(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``tokens`` to ``expected_probs``; 0 if a token outside
    the support was emitted (no sampler from p can do that)."""
    support = expected_probs > 0
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    if counts[~support].sum() > 0:
        return 0.0
    expected = expected_probs[support].double()
    expected = expected / expected.sum() * tokens.numel()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("impl", IMPLS)
def test_first_token_follows_target(impl):
    target, draft, token_ids, cu, u, bu, drafts = single_draft_batch(seed=0)
    device = "cuda" if impl is rejection_accept_triton else "cpu"
    accepted, bonus = (t.cpu() for t in impl(*(x.to(device) for x in (target, draft, token_ids, cu, u, bu))))
    first = torch.where(accepted == 1, drafts, bonus)
    assert p_value(first, P_FIRST) > ALPHA
    # After an accepted draft the bonus comes from the next target row.
    assert p_value(bonus[accepted == 1], P_NEXT) > ALPHA


@pytest.mark.parametrize("wrong", ["draft", "target"])
def test_wrong_residual_is_detected(wrong):
    """Bonus drawn from q or from p instead of max(0, p - q): the test above must fail."""
    target, draft, token_ids, cu, u, bu, drafts = single_draft_batch(seed=1)
    accepted, _ = rejection_accept_torch(target, draft, token_ids, cu, u, bu)
    rows = (P_FIRST if wrong == "target" else Q_FIRST).expand(NUM_DRAWS, -1)
    broken_bonus = sample_inverse_cdf(rows, bu)
    first = torch.where(accepted == 1, drafts, broken_bonus)
    assert p_value(first, P_FIRST) < ALPHA


def test_verify_sampling_matches_processed_target():
    """End to end through temperature and top-p: the drafter is processed the same way."""
    n, vocab = NUM_DRAWS // 2, 12
    g = gen(2)
    target_logits = torch.randn(vocab, generator=g) * 2
    draft_logits = target_logits + torch.randn(vocab, generator=g) * 1.5
    temperature, top_p = 0.7, 0.9
    p = process_logits(target_logits, temperature, top_p)
    q = process_logits(draft_logits, temperature, top_p)
    drafts = torch.multinomial(q.expand(n, vocab), 1, replacement=True, generator=g).squeeze(1)
    token_ids = torch.stack([torch.zeros(n, dtype=torch.int64), drafts], dim=1).reshape(-1)
    cu = cu_seqlens_from_lengths(torch.full((n,), 2, dtype=torch.int64))
    result = verify_sampling(
        target_logits.expand(2 * n, vocab),
        q.expand(2 * n, vocab),
        token_ids,
        cu,
        torch.full((n,), temperature),
        torch.full((n,), top_p),
        generator=gen(3),
    )
    first = torch.where(result.accepted == 1, drafts, result.bonus)
    assert (p == 0).any()  # top-p really cut something
    assert p_value(first, p) > ALPHA


def test_detection_does_not_rely_on_support_alone():
    # With q restricted to p's support, sampling the residual from q is still caught.
    q = torch.tensor([0.05, 0.10, 0.05, 0.15, 0.40, 0.25, 0.00])
    target, draft, token_ids, cu, u, bu, _ = single_draft_batch(seed=4)
    g = gen(5)
    drafts = torch.multinomial(q.expand(NUM_DRAWS, -1), 1, replacement=True, generator=g).squeeze(1)
    token_ids[1::2] = drafts
    draft[0::2] = q
    accepted, bonus = rejection_accept_torch(target, draft, token_ids, cu, u, bu)
    assert p_value(torch.where(accepted == 1, drafts, bonus), P_FIRST) > ALPHA
    broken = torch.where(accepted == 1, drafts, sample_inverse_cdf(q.expand(NUM_DRAWS, -1), bu))
    assert p_value(broken, P_FIRST) < ALPHA


@requires_triton
def test_triton_agrees_on_a_slice_of_the_draws():
    # The full 200k-draw batch is too slow for the CPU interpreter; a slice of it (with the
    # q = 0 and p = 0 tokens) must match the reference exactly, which carries the test over.
    n = 200
    target, draft, token_ids, cu, u, bu, _ = single_draft_batch(seed=0)
    case = (target[: 2 * n], draft[: 2 * n], token_ids[: 2 * n], cu[: n + 1], u[: 2 * n], bu[:n])
    want = rejection_accept_torch(*case)
    got = rejection_accept_triton(*to_device(*case))
    assert all(torch.equal(x.cpu(), w) for x, w in zip(got, want, strict=True))
