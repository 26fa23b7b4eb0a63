"""Rejection-sampling verification of a packed stream (lossless speculative sampling).

For request b with segment [s, e) and draft rows j = s .. e-2:
  draft token x = x_{j+1} is accepted iff ``uniforms[j] * q_j(x) < p_j(x)``, which is
  ``uniforms[j] < min(1, p_j(x) / q_j(x))`` for uniforms in [0, 1) without dividing: a
  token the drafter gave probability 0 is accepted iff p_j(x) > 0, and p = q = 0 rejects.
  Acceptance stops at the first rejection.
The bonus token is drawn by inverse CDF with ``bonus_uniforms[b]``:
  rejected at row r: from normalize(max(0, p_r - q_r)), or from p_r when that residual is
  all zero (p_r == q_r);
  all accepted: from p_{e-1}.
Inverse CDF returns the first index whose cumulative weight exceeds u * total, so tokens
of weight 0 are never drawn. Sums are taken in float64 so the Triton and torch versions
agree except on measure-zero ties at a CDF boundary.

Probabilities are read as float32; they are expected to be already temperature / top-p
processed (see ``dataplane.verify.process_logits``). The draft row at e-1 is never read.
"""

from __future__ import annotations

import torch

from dataplane.kernels._triton import tl, triton
from dataplane.kernels.segments import first_true_per_segment, token_segments

_BLOCK_V = 1024  # vocabulary entries per loop step
_BLOCK_K = 32  # draft rows per loop step


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row of non-negative, unnormalised weights.

    Args:
        weights: [N, V] non-negative.
        uniforms: [N] in [0, 1).
    Returns:
        [N] int64: the first index whose cumulative weight exceeds ``u * sum(weights)``.
        If rounding leaves no such index, the last index of positive weight; 0 for an
        all-zero row.
    """
    w = weights.to(torch.float64)
    cdf = w.cumsum(dim=-1)
    threshold = uniforms.to(torch.float64) * w.sum(dim=-1)
    idx = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(1)
    positive = w > 0
    vocab = w.shape[-1]
    last_positive = vocab - 1 - positive.flip(-1).to(torch.int8).argmax(dim=-1)
    last_positive = torch.where(positive.any(dim=-1), last_positive, torch.zeros_like(last_positive))
    return torch.where(idx < vocab, idx, last_positive)


def bonus_weights(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    """Weights the bonus token is drawn from.

    Args:
        target_rows: [N, V] p at the bonus row.
        draft_rows: [N, V] q at the bonus row (ignored where ``rejected`` is False).
        rejected: [N] bool, True when a draft token was rejected at this row.
    Returns:
        [N, V] float32: max(0, p - q) where rejected, p otherwise, and p where the residual
        is all zero.
    """
    p = target_rows.to(torch.float32)
    q = torch.where(rejected[:, None], draft_rows.to(torch.float32), torch.zeros((), device=p.device))
    residual = (p - q).clamp(min=0)
    empty = residual.to(torch.float64).sum(dim=-1) <= 0
    return torch.where(empty[:, None], p, residual)


def rejection_accept_torch(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rejection sampling.

    Args:
        target_probs: [T, V] p, row j is the target distribution after x_j.
        draft_probs: [T, V] q, row j is the distribution x_{j+1} was drawn from
            (row e-1 of each segment unused).
        token_ids: [T] int64 packed stream.
        cu_seqlens: [B+1] int64.
        uniforms: [T] in [0, 1), uniforms[j] decides draft token x_{j+1} (row e-1 unused).
        bonus_uniforms: [B] in [0, 1).
    Returns:
        accepted: [B] int64 in [0, k_hat-1]; bonus: [B] int64 token id.
    """
    T = token_ids.numel()
    seg, local = token_segments(cu_seqlens, T)
    num_drafts = cu_seqlens[1:] - cu_seqlens[:-1] - 1  # [B]
    is_draft_row = local < num_drafts[seg]
    # The last stream token wraps around; it is never a draft row, so the value is unused.
    next_tokens = torch.roll(token_ids, shifts=-1)[:, None]
    p_x = target_probs.gather(1, next_tokens).squeeze(1).to(torch.float32)
    q_x = draft_probs.gather(1, next_tokens).squeeze(1).to(torch.float32)
    rejected = is_draft_row & ~(uniforms.to(torch.float32) * q_x < p_x)
    accepted = first_true_per_segment(rejected, seg, local, num_drafts)

    bonus_row = cu_seqlens[:-1] + accepted
    weights = bonus_weights(target_probs[bonus_row], draft_probs[bonus_row], accepted < num_drafts)
    bonus = sample_inverse_cdf(weights, bonus_uniforms)
    return accepted, bonus


@triton.jit
def _rejection_kernel(
    p_ptr,  # [T, V] target probs
    p_stride,
    q_ptr,  # [T, V] draft probs
    q_stride,
    token_ids_ptr,  # [T]
    cu_seqlens_ptr,  # [B+1]
    uniforms_ptr,  # [T]
    bonus_uniforms_ptr,  # [B]
    accepted_ptr,  # [B] out
    bonus_ptr,  # [B] out
    V,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + b)
    end = tl.load(cu_seqlens_ptr + b + 1)
    num_drafts = (end - start - 1).to(tl.int32)

    # 1. Accept / reject every draft row, keep the first rejection.
    first_reject = num_drafts
    for off in range(0, num_drafts, BLOCK_K):
        i = off + tl.arange(0, BLOCK_K)
        is_draft = i < num_drafts
        row = start + i
        x = tl.load(token_ids_ptr + row + 1, mask=is_draft, other=0)
        p_x = tl.load(p_ptr + row * p_stride + x, mask=is_draft, other=0.0).to(tl.float32)
        q_x = tl.load(q_ptr + row * q_stride + x, mask=is_draft, other=0.0).to(tl.float32)
        u = tl.load(uniforms_ptr + row, mask=is_draft, other=0.0).to(tl.float32)
        reject_at = tl.where(is_draft & ~(u * q_x < p_x), i, num_drafts)
        first_reject = tl.minimum(first_reject, tl.min(reject_at, axis=0))
    tl.store(accepted_ptr + b, first_reject.to(tl.int64))

    # 2. Bonus row: residual max(0, p - q) after a rejection, plain p when all were kept
    #    (q is then masked to 0, and row e-1 of q is never read).
    rejected = first_reject < num_drafts
    bonus_row = start + first_reject
    p_row = p_ptr + bonus_row * p_stride
    q_row = q_ptr + bonus_row * q_stride
    # Masking q by "offs < q_len" keeps it at 0 on the unread rows (a scalar-bool mask
    # would do the same but is not accepted everywhere).
    q_len = tl.where(rejected, V, 0)
    total_residual = tl.full((), 0.0, tl.float64)
    total_p = tl.full((), 0.0, tl.float64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p = tl.load(p_row + offs, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        total_residual += tl.sum(tl.maximum(p - q, 0.0).to(tl.float64), axis=0)
        total_p += tl.sum(p.to(tl.float64), axis=0)
    # An all-zero residual means p == q: fall back to sampling p.
    use_p = total_residual <= 0.0
    total = tl.where(use_p, total_p, total_residual)
    q_len = tl.where(use_p, 0, q_len)

    # 3. Inverse CDF: first index whose running sum exceeds u * total.
    threshold = tl.load(bonus_uniforms_ptr + b).to(tl.float64) * total
    found = tl.full((), V, tl.int32)
    last_positive = tl.full((), -1, tl.int32)
    running = tl.full((), 0.0, tl.float64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p = tl.load(p_row + offs, mask=in_vocab, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        w = tl.maximum(p - q, 0.0).to(tl.float64)
        w = tl.where(in_vocab, w, 0.0)
        cdf = running + tl.cumsum(w, axis=0)
        found = tl.minimum(found, tl.min(tl.where(in_vocab & (cdf > threshold), offs, V), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0.0, offs, -1), axis=0))
        running += tl.sum(w, axis=0)
    token = tl.where(found < V, found, tl.maximum(last_positive, 0))
    tl.store(bonus_ptr + b, token.to(tl.int64))


def rejection_accept_triton(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rejection sampling; same contract as ``rejection_accept_torch``.

    One program per request: acceptance over its draft rows, then two passes over the
    vocabulary of its bonus row (totals, then the inverse CDF).
    """
    num_reqs = cu_seqlens.numel() - 1
    T, V = target_probs.shape
    accepted = torch.empty(num_reqs, dtype=torch.int64, device=target_probs.device)
    bonus = torch.empty(num_reqs, dtype=torch.int64, device=target_probs.device)
    if num_reqs == 0:
        return accepted, bonus
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    if draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    _rejection_kernel[(num_reqs,)](
        target_probs,
        target_probs.stride(0),
        draft_probs,
        draft_probs.stride(0),
        token_ids.contiguous(),
        cu_seqlens.contiguous(),
        uniforms.contiguous(),
        bonus_uniforms.contiguous(),
        accepted,
        bonus,
        V,
        BLOCK_K=_BLOCK_K,
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(V)),
    )
    return accepted, bonus
