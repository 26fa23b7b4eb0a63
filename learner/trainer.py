"""One OPD training step over a replay buffer, and the online length head (PAPER.md).

A step takes a buffer of supervised records and runs ``epochs`` passes over it in a
seeded random order, one record per micro-batch (the paper's batch size 1), stepping
AdamW every ``grad_accum`` records: lr 3e-4 for the drafter, 2e-4 for the length head.

Per record, ``anchors_per_record`` anchors are drawn inside the response (positions
prompt_len .. L-2). Block position i (1..k-1) of the block at anchor a predicts the
token at a + i; its target distribution is the target's full next-token distribution
at position a + i - 1 (exact, recomputed from the stored final hidden state). Block
positions past the end of the sequence are masked.

The length head trains online on the same drafter's hidden states, detached (the MSE
moves only the head). Its label a* comes from

- ``head_label = "rounds"``: the verify rounds the record carries. Round anchors are
  rebuilt from the round sequence (the first block sits on the first response token,
  each round moves the anchor by accepted + 1) and a* = accepted / (k_hat - 1) for
  rounds that drafted (k_hat > 1). These labels were produced by the drafter version
  that served the request, and re-tokenization may shift positions slightly, so they
  are approximate for the current drafter; records without usable rounds fall back to
- ``"simulated"``: the current drafter's greedy acceptance on the training blocks,
  computed exactly from the target's top-1: draft j is accepted while every earlier
  draft was, it equals the target's argmax at a + j - 1, and the realised sequence
  followed it (so the stored target states are those the verifier would have seen;
  on greedy responses this always holds). a* = accepted / (k - 1).
- ``"policy"``: the rounds the node's configured speculation policy (``dataplane.spec_policy``
  with ``PolicyConfig.of(settings.dataplane)``, at the cost model's priors) would serve the
  response in with the current drafter, and a* = accepted / (k_hat - 1) at each drafting
  round: the labels a node produces, for the drafter being trained.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from adaflash.config import LearnerConfig
from dataplane import spec_policy as sp
from dataplane.cost_model import CostModel
from dataplane.drafter import Drafter
from learner.anchors import sample_anchors
from learner.losses import distill_loss, head_loss
from learner.supervision import Supervised, Supervisor


def param_groups(drafter: Drafter, lr_drafter: float, lr_head: float) -> list[dict]:
    head = [p for n, p in drafter.named_parameters() if n.startswith("length_head.")]
    body = [p for n, p in drafter.named_parameters() if not n.startswith("length_head.")]
    return [{"params": body, "lr": lr_drafter, "name": "drafter"}, {"params": head, "lr": lr_head, "name": "head"}]


def round_anchors(sup: Supervised) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors and labels a* of the record's drafting rounds: ([R] int64, [R] float)."""
    anchors, labels = [], []
    pos = sup.prompt_len
    for r in sup.record.rounds:
        if pos > sup.length - 2:
            break
        if r.k_hat > 1:
            anchors.append(pos)
            labels.append(min(1.0, sp.head_label(r.accepted, r.k_hat)))
        pos += r.accepted + 1
    return torch.tensor(anchors, dtype=torch.int64), torch.tensor(labels, dtype=torch.float32)


def greedy_accepted(drafts: torch.Tensor, sup: Supervised, anchors: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of drafts [A, n] (target ids) at anchors [A] -> accepted counts [A].

    Draft j proposes the token at a + j. It is accepted iff drafts 1..j-1 were, it equals
    the target's argmax after position a + j - 1, and the realised sequence followed
    draft j - 1 (so that argmax is the one the verifier would compute).
    """
    A, n = drafts.shape
    L = sup.length
    pos = anchors.unsqueeze(1) + torch.arange(1, n + 1)  # [A, n] position each draft proposes
    match = (pos <= L) & (drafts == sup.top1[(pos - 1).clamp(max=L - 1)])
    followed = (pos <= L - 1) & (sup.tokens[pos.clamp(max=L - 1)] == drafts)
    prefix_ok = torch.cat([torch.ones(A, 1, dtype=torch.bool), followed[:, :-1]], dim=1)
    return torch.cumprod((match & prefix_ok).long(), dim=1).sum(1)


@torch.no_grad()
def policy_rounds(drafter: Drafter, sup: Supervised, policy: sp.PolicyConfig, cost,
                  node: sp.NodeState | None = None) -> tuple[list[sp.SimRound], torch.Tensor, torch.Tensor]:
    """The rounds a node running ``policy`` under ``cost`` would serve this response in with
    the current drafter (``spec_policy.simulate`` over its greedy acceptance at every
    anchor), and their anchors and labels a* for the rounds that drafted."""
    lo, hi = max(1, sup.prompt_len), sup.length - 2
    if hi < lo:
        return [], torch.empty(0, dtype=torch.int64), torch.empty(0)
    anchors = torch.arange(lo, hi + 1)
    h = drafter.forward_train(sup.ctx_hidden, sup.tokens, anchors)
    a_hat = drafter.length_head(h).float().tolist()
    drafts = drafter.to_target_ids(drafter.logits(h[:, 1:]).argmax(-1))
    accepted = greedy_accepted(drafts, sup, anchors).tolist()
    rounds = sp.simulate(a_hat, accepted, hi - lo + 1, policy, cost, node=node)
    drafted = [r for r in rounds if r.k_hat > 1]
    return (rounds, torch.tensor([lo + r.anchor for r in drafted], dtype=torch.int64),
            torch.tensor([min(1.0, sp.head_label(r.accepted, r.k_hat)) for r in drafted], dtype=torch.float32))


class Trainer:
    def __init__(self, drafter: Drafter, supervisor: Supervisor, cfg: LearnerConfig,
                 policy: sp.PolicyConfig | None = None):
        """``policy``: the node's speculation policy (``PolicyConfig.of(settings.dataplane)``),
        which ``head_label = "policy"`` walks at the drafter's block size; None: its defaults."""
        self.drafter = drafter
        self.sup = supervisor
        self.cfg = cfg
        self.policy = policy or sp.PolicyConfig()
        drafter.train().requires_grad_(True)
        self.opt = torch.optim.AdamW(param_groups(drafter, cfg.lr_drafter, cfg.lr_head))

    @property
    def k(self) -> int:
        return self.drafter.config.block_size

    def train_buffer(self, sups: list[Supervised], step: int) -> dict[str, float]:
        """One step: epochs x records, AdamW every grad_accum records. Returns mean metrics."""
        sums: dict[str, float] = defaultdict(float)
        n = 0
        self.opt.zero_grad(set_to_none=True)
        for epoch in range(self.cfg.epochs):
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 101 + epoch)
            order = torch.randperm(len(sups), generator=gen).tolist()
            for j, i in enumerate(order):
                parts = self._record(sups[i], gen)
                if parts:
                    n += 1
                    for key, v in parts.items():
                        sums[key] += v
                if (j + 1) % self.cfg.grad_accum == 0 or j == len(order) - 1:
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
        out = {key: v / max(n, 1) for key, v in sums.items()}
        out["records"] = float(len(sups))
        out["tokens"] = float(sum(s.length for s in sups))
        return out

    def _record(self, sup: Supervised, gen: torch.Generator) -> dict[str, float]:
        anchors = sample_anchors(sup.prompt_len, sup.length, self.cfg.anchors_per_record, gen)
        if not anchors.numel():
            return {}
        d, k = self.drafter, self.k
        h = d.forward_train(sup.ctx_hidden, sup.tokens, anchors)  # [A, k, H]
        pos = anchors.unsqueeze(1) + torch.arange(k - 1)  # target position of block position i+1
        mask = pos <= sup.length - 1
        p_logits = self.sup.target_logits(sup.final_hidden[pos.clamp(max=sup.length - 1)].reshape(-1, h.shape[-1]))
        q_logits = d.logits(h[:, 1:]).reshape(-1, d.vocab_map.numel() or d.config.vocab_size)
        out = distill_loss(q_logits, p_logits, mask.reshape(-1), kind=self.cfg.loss, alpha=self.cfg.alpha,
                           delta=self.cfg.delta, vocab_map=d.vocab_map)
        with torch.no_grad():
            drafts = d.to_target_ids(q_logits.view(len(anchors), k - 1, -1).argmax(-1))
            accepted = greedy_accepted(drafts, sup, anchors)
        head_h, a_star = h, sp.head_label(accepted.float(), k)
        r_anchors = None
        if self.cfg.head_label == "rounds" and sup.record.rounds:
            r_anchors, r_labels = round_anchors(sup)
        elif self.cfg.head_label == "policy":
            _, r_anchors, r_labels = policy_rounds(d, sup, dataclasses.replace(self.policy, block_size=k), CostModel())
        if r_anchors is not None:
            if r_anchors.numel():
                with torch.no_grad():
                    head_h = d.forward_train(sup.ctx_hidden, sup.tokens, r_anchors)
                a_star = r_labels
        hl = head_loss(d.length_head, head_h, a_star, self.cfg.head_loss)
        (out.loss + hl.loss).div(self.cfg.grad_accum).backward()
        return {**out.parts, **hl.parts, "sim_accept": float(accepted.float().mean()) / (k - 1),
                "sim_tau": float(accepted.float().mean()) + 1.0}
