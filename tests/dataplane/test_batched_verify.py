"""Sampled requests of one step are verified in one rejection-sampling call, and each
request's result is what verifying it alone gives (it draws from its own generator)."""

from __future__ import annotations

import pytest
import torch

import dataplane.spec_step as spec_step
from dataplane.cost_model import CostModel
from dataplane.sequence import SamplingParams, Sequence
from dataplane.spec_policy import PolicyConfig
from dataplane.spec_step import SpecStep, StepPlan
from dataplane.verify import verify_sampling

V = 40
KINDS = [  # (temperature, top_p, seed, presence_penalty)
    (0.0, 1.0, None, 0.0),  # plain greedy
    (0.8, 1.0, None, 0.0),  # sampled
    (1.3, 0.9, None, 0.0),  # sampled with top-p
    (0.7, 1.0, 5, 0.0),  # seeded: argmax on perturbed rows
    (1.0, 1.0, None, 0.6),  # sampled with a penalty: its own rows, batched with the others
    (0.0, 1.0, None, 0.4),  # greedy with a penalty
    (0.9, 0.8, None, 0.0),
]


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs, k_hat, probs, tokens = [], [], [], []
    for i, (temp, top_p, sd, pen) in enumerate(KINDS):
        k = int(torch.randint(1, 6, (1,), generator=g))
        s = Sequence(request_id=f"r{i}", prompt_ids=[1, 2],
                     params=SamplingParams(temperature=temp, top_p=top_p, seed=sd, presence_penalty=pen))
        s.output_ids = torch.randint(0, V, (3,), generator=g).tolist()
        s.generator = torch.Generator().manual_seed(100 + i) if temp > 0 else None
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1)
        drafts = torch.multinomial(q[: k - 1], 1, generator=g).squeeze(1) if k > 1 else torch.zeros(0).long()
        q[-1] = 0  # row k-1 is never read
        seqs.append(s)
        k_hat.append(k)
        probs.append(q if temp > 0 and sd is None else None)
        tokens.append(torch.cat([torch.tensor([s.last_token]), drafts]))
    token_ids = torch.cat(tokens)
    cu = torch.tensor([0] + torch.tensor(k_hat).cumsum(0).tolist())
    logits = torch.randn(int(token_ids.numel()), V, generator=g) * 3
    plan = StepPlan(seqs, k_hat, [0.5] * len(seqs), torch.zeros(len(seqs), 4, dtype=torch.int64), probs, 0.0)
    return seqs, plan, logits, token_ids, cu


def _alone(s: Sequence, q, rows, ids, gen) -> tuple[int, int]:
    """The request verified on its own, as the engine did before sampled requests were batched."""
    from dataplane.sampling import constrained_rows

    rows = constrained_rows(s, rows, ids[1:].tolist())
    q = q if q is not None else rows.new_zeros(rows.shape)
    r = verify_sampling(rows, q, ids, torch.tensor([0, len(ids)]), torch.tensor([s.params.temperature]),
                        torch.tensor([s.params.top_p]), gen)
    return int(r.accepted[0]), int(r.bonus[0])


@pytest.mark.parametrize("seed", range(8))
def test_sampled_requests_verify_together_as_alone(seed, monkeypatch):
    seqs, plan, logits, token_ids, cu = _setup(seed)
    sampled = [i for i, s in enumerate(seqs) if not s.greedy and not s.seeded]
    expected = {}
    for i in sampled:
        gen = torch.Generator()
        gen.set_state(seqs[i].generator.get_state())
        a, e = int(cu[i]), int(cu[i + 1])
        expected[i] = _alone(seqs[i], plan.draft_probs[i], logits[a:e], token_ids[a:e], gen)
    calls = []
    real = spec_step.verify_sampling
    monkeypatch.setattr(spec_step, "verify_sampling", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = SpecStep(None, PolicyConfig(mode="adaptive", block_size=8, gamma=1.0), CostModel())
    accepted, bonus = step._verify(seqs, plan, logits, token_ids, cu)
    assert len(calls) == 1  # one rejection-sampling call for every sampled request
    for i in sampled:
        assert (accepted[i], bonus[i]) == expected[i], i
    for i in range(len(seqs)):  # greedy and seeded requests: argmax of their rows
        assert 0 <= accepted[i] <= int(cu[i + 1] - cu[i]) - 1 and 0 <= bonus[i] < V
