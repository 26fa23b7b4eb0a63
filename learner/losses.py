"""Losses of on-policy distillation (PAPER.md, component 1) and of the length head (component 2).

Shapes: draft logits ``q_logits [N, Vd]`` and target logits ``p_logits [N, V]`` for N
block positions (blocks x positions 1..k-1 flattened), a validity mask ``mask [N]``
(positions past the end of a sequence are False), and the drafter's vocabulary map
``vocab_map [Vd]`` (empty: the draft vocabulary is the target's, Vd = V).

Every per-position loss is averaged over the valid positions, which is the paper's
(1/k) sum_i inside a block and a mean over blocks, with partial blocks at the end of a
response weighted by the positions they have.

Reduced draft vocabulary (q lives on Vd tokens, p on all V):
- reverse KL and its clipped form use the target's *full-vocabulary* probabilities at
  the draft tokens, not renormalised: q is zero outside Vd, so the terms there vanish
  (0 log 0 = 0) and sum_{y in Vd} q log(q/p) is exactly KL(q || p) of the distribution
  the node drafts from against the real target. Its minimum is -log p(Vd) > 0, not 0,
  but its gradient pushes q towards what the target accepts, which is what matters.
- forward KL (the OSD baseline) would be infinite wherever p has mass outside Vd, so p
  is renormalised over Vd there.
- hard cross-entropy: positions whose target top-1 token lies outside Vd cannot be
  drafted and are left out of l_hard (they still count in the KL terms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, the objective to minimise
    parts: dict[str, float] = field(default_factory=dict)  # detached values for metrics


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def target_logprobs_on_draft_vocab(p_logits: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """log p over the full target vocabulary, gathered at the draft tokens: [N, V] -> [N, Vd]."""
    logp = F.log_softmax(p_logits.float(), dim=-1)
    if vocab_map is not None and vocab_map.numel():
        logp = logp[:, vocab_map]
    return logp


def target_top1_in_draft_vocab(p_logits: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """Target argmax as an index into the draft vocabulary, -1 where it lies outside: [N] int64."""
    top1 = p_logits.argmax(dim=-1)
    if vocab_map is None or not vocab_map.numel():
        return top1
    inverse = torch.full((p_logits.shape[-1],), -1, dtype=torch.int64, device=top1.device)
    inverse[vocab_map] = torch.arange(vocab_map.numel(), device=top1.device)
    return inverse[top1]


def hard_ce(q_logits: torch.Tensor, target_idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the target's top-1 token. target_idx [N] in the draft vocabulary (-1: skip)."""
    ok = mask & (target_idx >= 0)
    ce = F.cross_entropy(q_logits.float(), target_idx.clamp_min(0), reduction="none")
    return _masked_mean(ce, ok)


def rkl_entries(q_logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Entry-wise reverse-KL terms q(y) log(q(y)/p(y)): [N, Vd]."""
    logq = F.log_softmax(q_logits.float(), dim=-1)
    return logq.exp() * (logq - logp)


def reverse_kl(q_logits: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(mean over valid positions) sum_y q log(q/p)."""
    return _masked_mean(rkl_entries(q_logits, logp).sum(-1), mask)


def reverse_kl_clipped(q_logits: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor,
                       delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over valid positions) sum_y min(q log(q/p), delta), clipped before the vocabulary sum.

    An entry above delta contributes the constant delta, so it passes no gradient: a few
    tokens the drafter over-weights cannot dominate the update. Returns (loss, share of
    the valid positions' entries that were clipped).
    """
    return clipped_sum(rkl_entries(q_logits, logp), mask, delta)


def clipped_sum(entries: torch.Tensor, mask: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """entries [N, Vd] -> (mean over valid positions of sum_y min(entry, delta), clipped share)."""
    loss = _masked_mean(torch.clamp(entries, max=delta).sum(-1), mask)
    per_pos = (entries > delta).float().mean(-1)
    return loss, _masked_mean(per_pos, mask).detach()


def forward_kl(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: torch.Tensor,
               vocab_map: torch.Tensor | None = None) -> torch.Tensor:
    """OSD baseline: (mean over valid positions) KL(p || q), p renormalised over the draft vocabulary."""
    pl = p_logits.float()
    if vocab_map is not None and vocab_map.numel():
        pl = pl[:, vocab_map]
    logp = F.log_softmax(pl, dim=-1)
    logq = F.log_softmax(q_logits.float(), dim=-1)
    return _masked_mean((logp.exp() * (logp - logq)).sum(-1), mask)


def distill_loss(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: torch.Tensor, *, kind: str = "opd",
                 alpha: float = 0.8, delta: float = 0.01,
                 vocab_map: torch.Tensor | None = None) -> LossOutput:
    """The drafter's objective, one of

    - ``opd``: alpha * l_hard + (1 - alpha) * l_rkl_clip (the paper's AdaFlash loss)
    - ``rkl``: reverse KL; ``rkl_clip``: entry-wise clipped reverse KL
    - ``osd``: forward KL (the OSD baseline); ``hard``: cross-entropy on the target's top-1

    q_logits [N, Vd] (grad), p_logits [N, V] (target, no grad), mask [N] bool.
    """
    p_logits = p_logits.detach()
    parts: dict[str, float] = {}
    top1 = target_top1_in_draft_vocab(p_logits, vocab_map)
    logp = target_logprobs_on_draft_vocab(p_logits, vocab_map)
    with torch.no_grad():
        q_top1 = q_logits.argmax(-1)
        parts["top1_match"] = float(_masked_mean((q_top1 == top1).float(), mask))
    if kind == "opd":
        lh = hard_ce(q_logits, top1, mask)
        lc, ratio = reverse_kl_clipped(q_logits, logp, mask, delta)
        loss = alpha * lh + (1 - alpha) * lc
        parts.update(hard=float(lh.detach()), rkl_clip=float(lc.detach()), clip_ratio=float(ratio))
    elif kind == "rkl":
        loss = reverse_kl(q_logits, logp, mask)
        parts["rkl"] = float(loss.detach())
    elif kind == "rkl_clip":
        loss, ratio = reverse_kl_clipped(q_logits, logp, mask, delta)
        parts.update(rkl_clip=float(loss.detach()), clip_ratio=float(ratio))
    elif kind == "osd":
        loss = forward_kl(q_logits, p_logits, mask, vocab_map)
        parts["fkl"] = float(loss.detach())
    elif kind == "hard":
        loss = hard_ce(q_logits, top1, mask)
        parts["hard"] = float(loss.detach())
    else:
        raise ValueError(f"unknown loss {kind!r}")
    parts["loss"] = float(loss.detach())
    return LossOutput(loss, parts)


def head_loss(length_head: torch.nn.Module, hidden: torch.Tensor, a_star: torch.Tensor,
              kind: str = "bce") -> LossOutput:
    """Length-head loss on drafter features detached from the drafter.

    hidden [B, k, H] final drafter hidden states; a_star [B] in [0, 1]. Only the head's
    parameters receive gradient: OPD moves the drafter, this loss only the head.

    kind "mse": the paper's MSE(a_hat, a*) through the sigmoid. Its gradient at the
    logit is 2 (a_hat - a*) a_hat (1 - a_hat), which vanishes once the sigmoid saturates,
    and acceptance labels are mostly 0 on a narrow stream, so an online head can pin at
    a_hat = 0 and never recover. kind "bce" (default): binary cross-entropy with the soft
    label a*, computed on the logit; its gradient there is a_hat - a*, which never
    vanishes. Both are minimised by the conditional mean of a*, so the head predicts the
    same quantity either way. MSE and MAE are reported for both.
    """
    z = length_head.logit(hidden.detach()).float()
    a_hat = torch.sigmoid(z)
    y = a_star.float()
    err = a_hat - y
    mse = (err ** 2).mean()
    if kind == "mse":
        loss = mse
    elif kind == "bce":
        loss = F.binary_cross_entropy_with_logits(z, y)
    else:
        raise ValueError(f"unknown head loss {kind!r}")
    return LossOutput(loss, {"head_mse": float(mse.detach()), "head_mae": float(err.detach().abs().mean())})
