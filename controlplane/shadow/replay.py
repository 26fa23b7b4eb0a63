"""Replay of one drafter on one feedback record, under the policy the nodes run.

prompt_text and response_text are re-tokenized with the target tokenizer and the frozen
target runs once over prompt + response, returning the hidden states of the layers the
drafters read. The realised response tokens are what the target committed; at
temperature 0 they are the target's argmax, so a draft is accepted exactly when it
equals them.

``trace_drafter`` drafts a full block at every anchor (every response position but the
last; the token at the anchor is the last committed one, as after an engine round) and
keeps what the policy needs: the length head's a_hat and the drafts verification keeps.
- greedy records: accepted(anchor) = longest prefix of the block's drafts equal to the
  realised tokens.
- sampled records (temperature > 0): the drafts are random, so per anchor the survival
  probabilities prod_{j<=i} alpha_j with alpha_j = sum_x min(p_j(x), q_j(x)), p the
  target's and q the drafter's sampling distributions, conditioned on the realised
  prefix; their sum is the expected number accepted.
- acceptance by block position i: share of anchors whose drafts 0..i were all accepted
  (full block); calibration samples (a_hat, accepted, drafts available).

``walk`` then runs ``dataplane.spec_policy.simulate`` over the trace: the same
reservation, length choice (break-even on the cost curve included), back-off, probe and
calibration calls the engine makes, at a given concurrency. Greedy: rounds, verified and
committed tokens of that walk. Sampled: the walk's lengths over the expected accepted
counts; tau = mean of 1 + expected accepted within each round's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from adaflash.contracts.feedback import FeedbackRecord
from dataplane import spec_policy as sp


@dataclass
class Trace:
    """What one drafter drafts at every anchor of one record (policy-independent)."""

    n_tokens: int = 0  # response tokens committed by rounds (all but the first, which prefill makes)
    a_hat: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)  # greedy: kept drafts; sampled: expected
    survival: list[list[float]] | None = None  # sampled: per anchor, P(drafts 1..i all kept)
    accept_num: list[float] = field(default_factory=list)  # per block position: accepted (sum)
    accept_den: list[float] = field(default_factory=list)  # per block position: anchors with it available
    calib: list[tuple[float, float, int]] = field(default_factory=list)  # (a_hat, accepted, available)


@dataclass
class Replay:
    """One drafter on one record, walked under the policy at one concurrency."""

    tokens: int = 0
    rounds: float = 0.0
    verified: float = 0.0  # tokens verified by the target over those rounds
    committed: float = 0.0  # tokens committed by those rounds (== tokens)
    drafted: float = 0.0  # rounds that ran the drafter
    k_hats: list[int] = field(default_factory=list)  # the verified length of every round
    expected_tau: float | None = None  # sampled records: mean 1 + expected accepted per round
    trace: Trace | None = None

    @property
    def accept_num(self) -> list[float]:
        return self.trace.accept_num if self.trace else []


@torch.inference_mode()
def target_pass(target, ids: list[int], layers: Sequence[int], want_logits_from: int | None):
    """One frozen-target forward over ``ids``: hidden states [L, len(layers), H] and, when
    asked, the logits of rows ``want_logits_from``..L-2 (each predicting the next token)."""
    L = len(ids)
    kv = target.new_cache(capacity=L)
    idx = (torch.arange(want_logits_from, L - 1, dtype=torch.int64) if want_logits_from is not None
           else torch.empty(0, dtype=torch.int64))
    out = target.forward_packed(torch.tensor(ids, dtype=torch.int64), [0, L], [kv], logits_index=idx,
                                hidden_layers=tuple(layers))
    return out.hidden, out.logits


def _greedy_block(drafter, h, tokens, anchors, n_avail, k) -> torch.Tensor:
    """Kept drafts per anchor, position by position, only where every earlier draft matched
    (a draft after the first mismatch can never be kept, so its logits are not computed)."""
    acc = torch.zeros(anchors.numel(), dtype=torch.int64)
    alive = torch.ones(anchors.numel(), dtype=torch.bool)
    for i in range(k - 1):
        idx = (alive & (n_avail > i)).nonzero().squeeze(1)
        if idx.numel() == 0:
            break
        drafts = drafter.to_target_ids(drafter.logits(h[idx, i + 1]).argmax(-1))
        ok = drafts == tokens[anchors[idx] + 1 + i]
        acc[idx[ok]] += 1
        alive[idx[~ok]] = False
    return acc


@torch.inference_mode()
def trace_drafter(drafter, hidden: torch.Tensor, ids: list[int], start: int, *, temperature: float = 0.0,
                  top_p: float = 1.0, target_logits: torch.Tensor | None = None, chunk: int = 32) -> Trace:
    """Draft a full block at every anchor start..L-2 of one sequence whose response starts at
    ``start``. hidden: the target's states of the drafter's layers [L, n, H];
    target_logits (sampled records): rows for positions start..L-2."""
    from dataplane.verify import process_logits

    L = len(ids)
    k = drafter.config.block_size
    tr = Trace(accept_num=[0.0] * (k - 1), accept_den=[0.0] * (k - 1))
    if start < 1 or L - 1 - start < 1:
        return tr
    tr.n_tokens = L - 1 - start
    tokens = torch.tensor(ids, dtype=torch.int64)
    anchors_all = torch.arange(start, L - 1, dtype=torch.int64)
    greedy = temperature <= 0
    if not greedy:
        tr.survival = []
        p_all = process_logits(target_logits, temperature, top_p)  # [L-1-start, V]
    for c in range(0, anchors_all.numel(), chunk):
        anchors = anchors_all[c : c + chunk]
        h = drafter.forward_train(hidden, tokens, anchors)  # [A, k, H]
        a_hat = drafter.length_head(h).float().tolist()
        n_avail = torch.clamp(L - 1 - anchors, max=k - 1)
        tr.a_hat += a_hat
        if greedy:
            acc = _greedy_block(drafter, h, tokens, anchors, n_avail, k)
            tr.accepted += [float(x) for x in acc.tolist()]
            for i in range(k - 1):
                tr.accept_den[i] += float((n_avail > i).sum())
                tr.accept_num[i] += float((acc > i).sum())
            tr.calib += list(zip(a_hat, acc.tolist(), n_avail.tolist(), strict=True))
            continue
        q = drafter.expand_probs(process_logits(drafter.logits(h[:, 1:]), temperature, top_p))  # [A, k-1, V]
        for j, a in enumerate(anchors.tolist()):
            n = int(n_avail[j])
            rows = p_all[a - start : a - start + n]  # p of tokens a+1..a+n
            surv = torch.cumprod(torch.minimum(rows, q[j, :n]).sum(-1).clamp(0.0, 1.0), 0)
            tr.survival.append(surv.tolist())
            tr.accepted.append(float(surv.sum()))
            for i in range(n):
                tr.accept_den[i] += 1
                tr.accept_num[i] += float(surv[i])
            tr.calib.append((a_hat[j], tr.accepted[-1], n))
    return tr


def walk(tr: Trace, policy: sp.PolicyConfig, cost, node: sp.NodeState | None = None, batch: int = 1) -> Replay:
    """The rounds the node's policy serves this trace in, at concurrency ``batch``."""
    rep = Replay(tokens=tr.n_tokens, trace=tr)
    if tr.n_tokens < 1:
        return rep
    kept = [round(a) for a in tr.accepted]
    rounds = sp.simulate(tr.a_hat, kept, tr.n_tokens, policy, cost, node=node, batch=batch)
    rep.k_hats = [r.k_hat for r in rounds]
    rep.drafted = float(sum(1 for r in rounds if r.k_hat > 1))
    if tr.survival is None:
        rep.rounds = float(len(rounds))
        rep.verified = float(sum(rep.k_hats))
        rep.committed = float(sum(r.accepted + 1 for r in rounds))
        return rep
    exp_tau = [1.0 + sum(tr.survival[r.anchor][: r.k_hat - 1]) for r in rounds]
    mean_tau = sum(exp_tau) / len(exp_tau)
    rep.expected_tau = mean_tau
    rep.rounds = tr.n_tokens / mean_tau
    rep.committed = float(tr.n_tokens)
    rep.verified = rep.rounds * sum(rep.k_hats) / len(rounds)
    rep.drafted *= rep.rounds / len(rounds)
    return rep


def replay_drafter(drafter, hidden: torch.Tensor, ids: list[int], start: int, *, policy: sp.PolicyConfig,
                   cost=None, node: sp.NodeState | None = None, batch: int = 1, temperature: float = 0.0,
                   top_p: float = 1.0, target_logits: torch.Tensor | None = None) -> Replay:
    """``trace_drafter`` then ``walk``: one drafter on one sequence, as a node serves it."""
    from dataplane.cost_model import CostModel

    tr = trace_drafter(drafter, hidden, ids, start, temperature=temperature, top_p=top_p,
                       target_logits=target_logits)
    return walk(tr, policy, cost if cost is not None else CostModel(), node=node, batch=batch)


def encode_record(tokenizer, record: FeedbackRecord, max_tokens: int) -> tuple[list[int], int] | None:
    """prompt + response ids (response cut to fit ``max_tokens``) and the response start."""
    prompt = tokenizer.encode(record.prompt_text)
    response = tokenizer.encode(record.response_text)
    if not prompt or len(response) < 2:
        return None
    if len(prompt) >= max_tokens - 2:
        return None
    response = response[: max_tokens - len(prompt)]
    return prompt + response, len(prompt)
