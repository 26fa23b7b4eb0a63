"""rejection_accept: the Triton kernel and the torch reference against a plain loop."""

from __future__ import annotations

import pytest
import torch

from dataplane import kernels
from dataplane.kernels import (
    rejection_accept,
    rejection_accept_torch,
    rejection_accept_triton,
    sample_inverse_cdf,
)
from tests.dataplane.kernels.helpers import (
    gen,
    random_k_hat,
    requires_triton,
    segments,
    stream_layout,
    to_device,
)


def inverse_cdf_naive(weights: list[float], u: float) -> int:
    total = sum(weights)
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        if running > u * total:
            return i
    raise AssertionError("threshold not reached")


def rejection_naive(p, q, token_ids, cu_seqlens, uniforms, bonus_uniforms):
    accepted, bonus = [], []
    for b, (s, e) in enumerate(segments(cu_seqlens)):
        n = 0
        while n < e - s - 1:
            j, x = s + n, int(token_ids[s + n + 1])
            p_x, q_x = float(p[j, x]), float(q[j, x])
            ratio = float("inf") if q_x == 0 and p_x > 0 else (0.0 if q_x == 0 else p_x / q_x)
            if not float(uniforms[j]) < min(1.0, ratio):
                break
            n += 1
        r = s + n
        weights = p[r].double()
        if n < e - s - 1:
            residual = (p[r] - q[r]).clamp(min=0).double()
            weights = residual if residual.sum() > 0 else weights
        accepted.append(n)
        bonus.append(inverse_cdf_naive(weights.tolist(), float(bonus_uniforms[b])))
    return torch.tensor(accepted), torch.tensor(bonus)


def make_case(k_hat: torch.Tensor, vocab: int, seed: int, closeness: float = 0.3):
    """p, q sharing most of their logits (so drafts are often kept), drafts drawn from q."""
    g = gen(seed)
    cu, T = stream_layout(k_hat)
    base = torch.randn(T, vocab, generator=g) * 3
    p = torch.softmax(base, dim=-1)
    q = torch.softmax(base + closeness * torch.randn(T, vocab, generator=g), dim=-1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)  # row j drafts x_{j+1}
    token_ids = torch.randint(0, vocab, (T,), generator=g)
    token_ids[1:] = drafts[:-1]
    token_ids[cu[:-1]] = torch.randint(0, vocab, (k_hat.numel(),), generator=g)  # committed tokens
    uniforms = torch.rand(T, generator=g)
    bonus_uniforms = torch.rand(k_hat.numel(), generator=g)
    return p, q, token_ids, cu, uniforms, bonus_uniforms


def check(case, triton: bool = True, naive: bool = True):
    ref = rejection_accept_torch(*case)
    if naive:
        want = rejection_naive(*case)
        assert all(torch.equal(r, w) for r, w in zip(ref, want, strict=True))
    if triton:
        got = rejection_accept_triton(*to_device(*case))
        assert all(torch.equal(x.cpu(), r) for x, r in zip(got, ref, strict=True))
    return ref


@requires_triton
@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_streams(num_reqs, seed):
    k_hat = random_k_hat(num_reqs, 16, gen(seed))
    accepted, _ = check(make_case(k_hat, vocab=1000, seed=seed))
    if num_reqs == 64:
        assert 0 < accepted.sum() < (k_hat - 1).sum()


@requires_triton
def test_large_vocab_not_power_of_two():
    k_hat = torch.tensor([4, 1, 6])
    check(make_case(k_hat, vocab=49152, seed=2), naive=False)


@requires_triton
@pytest.mark.parametrize("vocab", [5, 1000])
def test_random_streams_low_precision(vocab):
    p, q, token_ids, cu, u, bu = make_case(random_k_hat(32, 8, gen(vocab)), vocab=vocab, seed=vocab)
    check((p.bfloat16(), q.half(), token_ids, cu, u, bu), naive=False)


@requires_triton
def test_all_accepted_samples_bonus_from_last_target_row():
    k_hat = torch.tensor([1, 16, 5, 2])
    p, q, token_ids, cu, u, bu = make_case(k_hat, vocab=1000, seed=3)
    u.zero_()  # 0 * q < p for every token p gives mass: everything is kept
    q[cu[1:] - 1] = float("nan")  # row e-1 of q is never read
    accepted, bonus = check((p, q, token_ids, cu, u, bu), naive=False)
    assert torch.equal(accepted, k_hat - 1)
    assert torch.equal(bonus, sample_inverse_cdf(p[cu[1:] - 1], bu))


@requires_triton
def test_first_draft_rejected_samples_from_residual():
    k_hat = torch.tensor([5, 3, 16])
    p, q, token_ids, cu, u, bu = make_case(k_hat, vocab=1000, seed=4)
    starts = cu[:-1]
    p[starts, token_ids[starts + 1]] = 0.0  # the target never produces the first draft
    accepted, bonus = check((p, q, token_ids, cu, u, bu))
    assert accepted.tolist() == [0, 0, 0]
    residual = (p[starts] - q[starts]).clamp(min=0)
    assert torch.equal(bonus, sample_inverse_cdf(residual, bu))
    assert (residual[torch.arange(3), bonus] > 0).all()


@requires_triton
def test_zero_draft_probability():
    # q(x) = 0 with p(x) > 0 is accepted whatever the uniform; p(x) = q(x) = 0 is rejected.
    k_hat = torch.tensor([3, 3])
    p, q, token_ids, cu, u, bu = make_case(k_hat, vocab=50, seed=5)
    u.fill_(0.999)
    q[0, token_ids[1]] = 0.0
    q[1, token_ids[2]] = 0.0
    p[1, token_ids[2]] = 0.0
    q[3, token_ids[4]] = 0.0
    accepted, _ = check((p, q, token_ids, cu, u, bu))
    assert accepted.tolist()[0] == 1
    assert accepted.tolist()[1] >= 1


@requires_triton
def test_equal_distributions_fall_back_to_target():
    # Rejected at a row where p == q: the residual is empty and the bonus comes from p.
    vocab = 64
    k_hat = torch.tensor([2, 4])
    p, q, token_ids, cu, u, bu = make_case(k_hat, vocab=vocab, seed=6)
    starts = cu[:-1]
    p[starts, token_ids[starts + 1]] = 0.0
    p[starts] /= p[starts].sum(dim=-1, keepdim=True)
    q[starts] = p[starts]
    accepted, bonus = check((p, q, token_ids, cu, u, bu))
    assert accepted.tolist() == [0, 0]
    assert torch.equal(bonus, sample_inverse_cdf(p[starts], bu))


@requires_triton
def test_no_drafts_sample_from_target():
    k_hat = torch.ones(64, dtype=torch.int64)
    p, q, token_ids, cu, u, bu = make_case(k_hat, vocab=100, seed=7)
    accepted, bonus = check((p, q, token_ids, cu, u, bu))
    assert accepted.sum() == 0
    assert torch.equal(bonus, sample_inverse_cdf(p, bu))


@requires_triton
def test_deterministic_for_fixed_uniforms():
    case = to_device(*make_case(random_k_hat(16, 8, gen(8)), vocab=500, seed=8))
    first = rejection_accept_triton(*case)
    second = rejection_accept_triton(*case)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_inverse_cdf_edges():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3 + [[0.0] * 5])
    u = torch.tensor([0.0, 0.5, 0.9999999, 0.3])
    # u = 0 takes the first token with mass, u -> 1 the last; zero weights are never drawn.
    assert sample_inverse_cdf(weights, u).tolist() == [1, 3, 3, 0]


@requires_triton
def test_dispatcher_forced(monkeypatch):
    case = make_case(torch.tensor([3, 4]), vocab=100, seed=9)
    monkeypatch.setenv(kernels.FORCE_TRITON_ENV, "1")
    got = rejection_accept(*case)
    want = rejection_naive(*case)
    assert all(torch.equal(x, w) for x, w in zip(got, want, strict=True))
