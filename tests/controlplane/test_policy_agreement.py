"""One policy, everywhere: a constructed cost curve and acceptance profile drive
``dataplane.spec_policy``, and the engine (tiny model), the shadow replay and the
learner's policy labels choose the same verified lengths, request by request."""

from __future__ import annotations

import pytest
import torch

from controlplane.shadow import replay_drafter, target_pass
from dataplane import spec_policy as sp
from dataplane.cost_model import CostModel
from dataplane.drafter import new_drafter
from learner.supervision import Supervised
from learner.trainer import policy_rounds
from tests.controlplane.shadow_util import train_drafter
from tests.dataplane.engine_util import make_engine, prompts, run

K = 8
# Step time per verify length at concurrency 1: up to three rows cost about one, the
# fourth costs far more, and rows beyond are cheap again (a CPU's step is not linear).
CURVE = {1: 0.010, 2: 0.0104, 3: 0.0108, 4: 0.016, 5: 0.0163, 6: 0.0166, 7: 0.0169, 8: 0.0172}


class FrozenCost(CostModel):
    """The constructed curve, which serving does not move (no observations)."""

    def __init__(self, draft_s: float = 0.002):
        super().__init__(draft_per_request_s=draft_s)
        for m, t in CURVE.items():
            self.set_point(1, m, t)

    def observe_verify(self, batch: int, tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, batch: int, seconds: float) -> None:
        pass


POLICY = sp.PolicyConfig(mode="adaptive", block_size=K, breakeven=True)


def test_the_constructed_profile_drives_the_policy():
    """Acceptance profile: a strong stretch, then a dead one, then strong again. The policy
    verifies the lengths the curve makes pay, backs off on the dead stretch, probes with a
    short block and returns to full lengths when drafts are kept again."""
    cost = FrozenCost()
    n = 120
    strong = [0.9] * 40 + [0.0] * 40 + [0.9] * 40
    kept = [7] * 40 + [0] * 40 + [7] * 40
    rounds = sp.simulate(strong, kept, n, POLICY, cost)
    k_hats = [r.k_hat for r in rounds]
    by_anchor = {r.anchor: r.k_hat for r in rounds}
    assert max(by_anchor[a] for a in by_anchor if a < 40) == K  # cheap rows after the knee: the whole block
    dead = [r for r in rounds if 40 <= r.anchor < 80]
    assert sum(1 for r in dead if r.k_hat == 1) >= len(dead) // 2  # backed off
    assert any(r.k_hat == POLICY.consts.probe_length for r in dead)  # probes
    # a kept probe ends the back-off: blocks longer than the probe come back
    assert max(r.k_hat for r in rounds if r.anchor >= 80) > POLICY.consts.probe_length
    assert sum(r.accepted + 1 for r in rounds) == n and len(k_hats) == len(rounds)


@pytest.fixture(scope="module")
def drafter(tiny_target):
    seqs = run(make_engine(tiny_target, "ar"), prompts(6, 97, seed=11, lo=4, hi=12), max_tokens=24)
    d = new_drafter(tiny_target, seed=3, num_layers=1, n_target_layers=2, block_size=K)
    return train_drafter(d, tiny_target, [s.prompt_ids + s.output_ids for s in seqs], steps=140, lr=4e-3)


def _supervised(target, ids: list[int], start: int, layers: list[int]) -> Supervised:
    final = target.args.num_layers - 1
    hidden, _ = target_pass(target, ids, [*layers, final], None)
    with torch.no_grad():
        top1 = target.lm_head(target.model.norm(hidden[:, -1])).argmax(-1)
    return Supervised(None, torch.tensor(ids), start, hidden[:, :-1].contiguous(), hidden[:, -1].contiguous(), top1)


def test_engine_replay_and_learner_choose_the_same_lengths(tiny_target, drafter):
    ps = prompts(6, 97, seed=12, lo=4, hi=12)
    eng = make_engine(tiny_target, "adaptive", drafter, max_running=1)
    eng.cost = eng.step_runner.cost = FrozenCost()
    served = run(eng, ps, max_tokens=24)
    layers = list(drafter.config.target_layers)
    replay_node, learner_node = sp.NodeState(), sp.NodeState()  # one node serves the requests in turn
    all_k = []
    for s in served:
        ids = s.prompt_ids + s.output_ids
        engine_k = [r.k_hat for r in s.rounds]
        hidden, _ = target_pass(tiny_target, ids, layers, None)
        rep = replay_drafter(drafter, hidden, ids, len(s.prompt_ids), policy=POLICY, cost=FrozenCost(),
                             node=replay_node)
        rounds, _, _ = policy_rounds(drafter, _supervised(tiny_target, ids, len(s.prompt_ids), layers), POLICY,
                                     FrozenCost(), node=learner_node)
        assert rep.k_hats == engine_k
        assert [r.k_hat for r in rounds] == engine_k
        assert [r.accepted for r in rounds] == [r.accepted for r in s.rounds]
        all_k += engine_k
    assert len(set(all_k)) >= 2  # the walk really chose between lengths
