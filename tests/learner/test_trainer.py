"""Target supervision, greedy acceptance, an OPD step that learns, and checkpoint round trips."""

from __future__ import annotations

import pytest
import torch

from adaflash.config import LearnerConfig
from dataplane.target_cache import target_identity
from dataplane.tokenizer import Tokenizer
from learner.checkpoint import CheckpointStore, Done
from learner.supervision import TOO_LONG, TOO_SHORT, UNKNOWN_TARGET, Supervised, Supervisor, Unusable
from learner.trainer import Trainer, greedy_accepted, round_anchors
from tests.learner.conftest import make_drafter
from tests.learner.tiny import make_record


@pytest.fixture(scope="module")
def supervisor(target, target_dir):
    drafter = make_drafter(target)
    return Supervisor(target, Tokenizer(target_dir), target_identity(target_dir), drafter.config.target_layers,
                      max_tokens=200)


def test_supervision_matches_a_plain_target_forward(supervisor, target):
    chat = supervisor.tok.apply_chat([{"role": "user", "content": "hello there"}])
    recs = [make_record(prompt=chat, response="general kenobi " * 3), make_record(response="abc def ghi")]
    toks = [supervisor.tokenize(r) for r in recs]
    assert toks[0].ids[:1] == [1] and toks[1].ids[:1] != [1]  # as the node sent them: chat templated, raw as is
    sups = supervisor.supervise(toks)
    for t, s in zip(toks, sups, strict=True):
        ids = torch.tensor(t.ids)
        ref = target.forward_packed(ids, [0, len(ids)], [target.new_cache()],
                                    hidden_layers=tuple(supervisor.hidden_layers))
        assert torch.equal(s.tokens, ids) and s.prompt_len == t.prompt_len
        # the same float32 math; a lone prompt attends in the C kernel, packed ones in PyTorch's
        # grouped products, so the sums' order differs (about 1e-6 of the values)
        assert torch.allclose(s.ctx_hidden, ref.hidden, rtol=1e-4, atol=1e-4)
        assert torch.allclose(supervisor.target_logits(s.final_hidden), ref.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(s.top1, ref.logits.argmax(-1))


def test_chat_prompt_format_wraps_bare_user_messages(supervisor):
    wrap = Supervisor(supervisor.target, supervisor.tok, supervisor.identity, list(supervisor.hidden_layers),
                      prompt_format="chat")
    expected = supervisor.tok.encode(supervisor.tok.apply_chat([{"role": "user", "content": "hi"}]))
    assert wrap.prompt_ids("hi") == expected and supervisor.prompt_ids("hi") == supervisor.tok.encode("hi")
    assert wrap.prompt_ids(supervisor.tok.apply_chat([{"role": "user", "content": "hi"}])) == expected


def test_unusable_records_carry_a_reason(supervisor):
    cases = [(make_record(target_id="other-model"), UNKNOWN_TARGET), (make_record(sha256="f" * 64), UNKNOWN_TARGET),
             (make_record(response="x" * 500), TOO_LONG), (make_record(response="x"), TOO_SHORT)]
    for rec, reason in cases:
        with pytest.raises(Unusable) as e:
            supervisor.tokenize(rec)
        assert e.value.reason == reason


def test_greedy_acceptance_equals_a_brute_force_walk():
    g = torch.Generator().manual_seed(0)
    L, n = 40, 7
    top1 = torch.randint(0, 3, (L,), generator=g)
    tokens = torch.cat([torch.tensor([0]), top1[:-1]])  # a greedy response: each token is the previous top-1
    tokens[25] = (tokens[25] + 1) % 3  # one sampled token where the response left the greedy path
    sup = Supervised(None, tokens, 2, torch.zeros(L, 1, 1), torch.zeros(L, 1), top1)
    anchors = torch.arange(2, L - 1)
    drafts = torch.randint(0, 3, (anchors.numel(), n), generator=g)
    drafts[::3] = top1[(anchors[::3].unsqueeze(1) + torch.arange(n)).clamp(max=L - 1)]  # some fully right blocks
    got = greedy_accepted(drafts, sup, anchors)
    for b, a in enumerate(anchors.tolist()):
        acc = 0
        for j in range(1, n + 1):
            p = a + j
            if p > L or int(drafts[b, j - 1]) != int(top1[p - 1]):
                break
            acc += 1
            if p > L - 1 or int(tokens[p]) != int(drafts[b, j - 1]):
                break  # the verifier's next state is unknown from this record
        assert int(got[b]) == acc, (a, drafts[b].tolist())
    assert got.max() > 1


def test_opd_steps_lower_the_loss_and_train_the_head(supervisor, target, tmp_path):
    cfg = LearnerConfig(buffer_size=4, anchors_per_record=4, head_label="simulated", lr_drafter=3e-3, lr_head=3e-3)
    drafter = make_drafter(target, seed=1)
    trainer = Trainer(drafter, supervisor, cfg)
    recs = [make_record(response=f"the answer is {i} and {i + 1}. ") for i in range(4)]
    sups = supervisor.supervise([supervisor.tokenize(r) for r in recs])
    first = trainer.train_buffer(sups, step=1)
    for step in range(2, 6):
        last = trainer.train_buffer(sups, step=step)
    assert last["loss"] < first["loss"]
    assert {"hard", "rkl_clip", "clip_ratio", "head_mse", "head_mae", "sim_tau"} <= set(last)
    # checkpoint round trip restores weights and optimizer moments exactly
    store = CheckpointStore(tmp_path / "state")
    name = store.write_weights(5, drafter, trainer.opt)
    store.commit(5, name, [Done(r.record_id, r.tenant_id, "trained") for r in recs], "t", {0: 4})
    store.close()
    fresh = Trainer(make_drafter(target, seed=9), supervisor, cfg)
    store = CheckpointStore(tmp_path / "state")
    assert store.load_into(fresh.drafter, fresh.opt) and store.step == 5 and store.offsets("t") == {0: 4}
    for (n1, p1), (_, p2) in zip(drafter.state_dict().items(), fresh.drafter.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1
    assert all(store.seen(r.record_id) for r in recs) and len(store.ledger()) == 4


def test_an_uncommitted_weights_file_is_discarded_on_reopen(target, tmp_path):
    store = CheckpointStore(tmp_path / "s")
    d = make_drafter(target)
    store.commit(1, store.write_weights(1, d, None), [], "t", {0: 1})
    store.write_weights(2, d, None)  # killed before the transaction
    store.close()
    store = CheckpointStore(tmp_path / "s")
    assert store.step == 1 and [p.name for p in store.dir.glob("weights-*.pt")] == ["weights-00000001.pt"]


def test_head_labels_from_the_records_verify_rounds(supervisor, target):
    rounds = [{"k_hat": 4, "accepted": 2, "a_hat": 0.3}, {"k_hat": 1, "accepted": 0, "a_hat": 0.0},
              {"k_hat": 8, "accepted": 7, "a_hat": 0.9}, {"k_hat": 8, "accepted": 0, "a_hat": 0.9}]
    rec = make_record(response="a fairly long response that has room for every round", rounds=rounds)
    sup = supervisor.supervise([supervisor.tokenize(rec)])[0]
    anchors, labels = round_anchors(sup)
    P = sup.prompt_len
    assert anchors.tolist() == [P, P + 4, P + 12]  # each round moves the anchor by accepted + 1
    assert labels.tolist() == pytest.approx([2 / 3, 1.0, 0.0])
    # the trainer fits the head to these labels: its error on them shrinks
    cfg = LearnerConfig(anchors_per_record=2, lr_head=1e-2, epochs=1, grad_accum=1, head_label="rounds")
    trainer = Trainer(make_drafter(target, seed=4), supervisor, cfg)
    maes = [trainer.train_buffer([sup], step=s)["head_mae"] for s in range(1, 30)]
    assert maes[-1] < maes[0]


def test_head_labels_from_the_policys_own_walk(supervisor, target):
    """head_label "policy": the rounds the node's policy would serve the response in with the
    current drafter (spec_policy.simulate), labelled a* = accepted / (k_hat - 1)."""
    from dataplane import spec_policy as sp
    from dataplane.cost_model import CostModel
    from learner.trainer import policy_rounds

    rec = make_record(response="a fairly long response that has room for several rounds of drafting")
    sup = supervisor.supervise([supervisor.tokenize(rec)])[0]
    drafter = make_drafter(target, seed=4)
    policy = sp.PolicyConfig(block_size=drafter.config.block_size, breakeven=False)
    rounds, anchors, labels = policy_rounds(drafter, sup, policy, CostModel())
    assert sum(r.accepted + 1 for r in rounds) == sup.length - 1 - sup.prompt_len
    drafted = [r for r in rounds if r.k_hat > 1]
    assert drafted  # the paper's rule drafts on an untrained head's a_hat near 0.5
    assert anchors.tolist() == [sup.prompt_len + r.anchor for r in drafted]
    assert labels.tolist() == pytest.approx([r.accepted / (r.k_hat - 1) for r in drafted])
    cfg = LearnerConfig(anchors_per_record=2, lr_head=1e-2, epochs=1, grad_accum=1, head_label="policy")
    out = Trainer(drafter, supervisor, cfg).train_buffer([sup], step=1)
    assert "head_mae" in out
