"""Sampling is lossless: speculative output follows the target's distribution exactly.

A tiny real model (vocabulary 16) gives the target's next-token distributions; a random
drafter gives a deliberately poor draft distribution. 100k speculative rounds are
verified by the serving path's ``verify_sampling`` (vectorised: every round is one
request of a packed stream). The joint distribution of the first two emitted tokens must
match p(x1) p(x2 | x1) (chi-square p > 0.01), and must not once the residual step is
broken (bonus drawn from p instead of normalize(max(0, p - q))).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dataplane.drafter import new_drafter
from dataplane.model import TargetModel
from dataplane.verify import process_logits, verify_sampling
from tests.tiny_models import save_tiny

V, N = 16, 100_000


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    d = save_tiny(tmp_path_factory.mktemp("tiny16"), vocab=V, hidden=32, layers=2, heads=2, kv_heads=1, seed=5,
                  embed_std=0.12, tie=False)
    target = TargetModel.from_pretrained(d)
    ctx = torch.tensor([3, 7, 1, 12, 9, 4])
    # Target logits after ctx, after ctx + a, and after ctx + a + b, for every a, b.
    l0 = target.forward_packed(ctx, [0, len(ctx)], [target.new_cache()]).logits[-1]
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    stream = torch.cat([torch.cat([ctx, p]) for p in pairs])
    n = len(ctx) + 2
    out = target.forward_packed(stream, [i * n for i in range(V * V + 1)], [target.new_cache() for _ in pairs])
    rows = out.logits.view(V * V, n, V)
    l1 = rows[::V, -2]  # [V] rows: after ctx + a (same for every b)
    l2 = rows[:, -1].view(V, V, V)  # after ctx + a + b
    drafter = new_drafter(target, seed=11, num_layers=1, n_target_layers=2, block_size=4)
    hidden = target.forward_packed(ctx, [0, len(ctx)], [target.new_cache()],
                                   hidden_layers=tuple(drafter.config.target_layers)).hidden
    kv = drafter.new_cache()
    drafter.extend_context(hidden[:-1], [0, len(ctx) - 1], [kv])
    h = drafter.forward_block(ctx[-1:], [kv])
    q_logits = drafter.logits(h[0, 1:3]) * 3.0  # sharpen: a confident, wrong drafter
    return l0, l1, l2, q_logits


def _round(l0_rows, l1_rows, l2_rows, q, temp, top_p, gen, broken: bool):
    """One speculative round of k_hat = 3 for each of M requests; returns emitted tokens [M, 3] (-1 pad)."""
    M = l0_rows.shape[0]
    qp = process_logits(q, temp, top_p)  # [2, V]
    d1 = torch.multinomial(qp[0].expand(M, V), 1, generator=gen).squeeze(1)
    d2 = torch.multinomial(qp[1].expand(M, V), 1, generator=gen).squeeze(1)
    last = torch.zeros(M, dtype=torch.int64)
    tokens = torch.stack([last, d1, d2], 1).reshape(-1)
    logits = torch.stack([l0_rows, l1_rows(d1), l2_rows(d1, d2)], 1).reshape(-1, V)
    draft = torch.stack([qp[0].expand(M, V), qp[1].expand(M, V), torch.zeros(M, V)], 1).reshape(-1, V)
    cu = torch.arange(0, 3 * M + 1, 3)
    res = verify_sampling(logits, draft, tokens, cu, torch.full((M,), temp), torch.full((M,), top_p), gen)
    acc, bonus = res.accepted, res.bonus
    if broken:  # on rejection, draw from p itself instead of the residual
        p = process_logits(logits.view(M, 3, V), temp, top_p)
        rej = acc < 2
        row = p[torch.arange(M), acc.clamp(max=2)]
        redraw = torch.multinomial(row, 1, generator=gen).squeeze(1)
        bonus = torch.where(rej, redraw, bonus)
    d = torch.stack([d1, d2], 1)
    out = torch.full((M, 3), -1)
    for a in range(3):
        m = acc == a
        if a:
            out[m, :a] = d[m, :a]
        out[m, a] = bonus[m]
    return out


@pytest.mark.parametrize("temp,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("broken", [False, True])
def test_joint_of_two_tokens_matches_target(setting, temp, top_p, broken):
    l0, l1, l2, q = setting
    gen = torch.Generator().manual_seed(1234)
    first = _round(l0.expand(N, V), lambda a: l1[a], lambda a, b: l2[a, b], q, temp, top_p, gen, broken)
    x1 = first[:, 0]
    x2 = first[:, 1].clone()
    need = x2 < 0  # the round emitted one token: the second comes from the next round, after x1
    if need.any():
        ctx1 = x1[need]
        nxt = _round(l1[ctx1], lambda a: l2[ctx1, a], lambda a, b: l2[ctx1, a], q, temp, top_p, gen, broken)
        x2[need] = nxt[:, 0]
    observed = torch.bincount(x1 * V + x2, minlength=V * V).double()
    p0 = process_logits(l0, temp, top_p).double()
    p1 = process_logits(l1, temp, top_p).double()
    expected = (p0[:, None] * p1).reshape(-1) * N
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    exp = exp * obs.sum() / exp.sum()
    pvalue = chisquare(obs.numpy(), exp.numpy()).pvalue
    if broken:
        assert pvalue < 0.01, pvalue
    else:
        assert pvalue > 0.01, pvalue
