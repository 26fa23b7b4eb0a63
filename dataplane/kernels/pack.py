"""Pack per-request draft blocks into one flat verify stream.

Request b contributes k_hat[b] tokens, ``[last_tokens[b], drafts[b, :k_hat[b] - 1]]``,
at positions ``seq_lens[b] + arange(k_hat[b])``. Segments are laid out back to back in
request order, so the stream holds T = sum(k_hat) tokens and request b owns rows
[cu_seqlens[b], cu_seqlens[b + 1]).

Preconditions (not checked on the hot path): 1 <= k_hat[b] <= K, where drafts is
[B, K-1].
"""

from __future__ import annotations

import torch

from dataplane.kernels._triton import tl, triton
from dataplane.kernels.segments import token_segments

# Stream rows handled per loop step of the pack kernel (block sizes are at most a few dozen).
_PACK_BLOCK = 32


def cu_seqlens_from_lengths(k_hat: torch.Tensor) -> torch.Tensor:
    """[B] int64 segment lengths -> [B+1] int64 cumulative offsets starting at 0."""
    cu = torch.zeros(k_hat.numel() + 1, dtype=torch.int64, device=k_hat.device)
    torch.cumsum(k_hat, dim=0, out=cu[1:])
    return cu


def _num_tokens(cu_seqlens: torch.Tensor, num_tokens: int | None) -> int:
    # Reading T from the device is a sync; callers that already know it pass it in.
    return int(cu_seqlens[-1].item()) if num_tokens is None else num_tokens


def pack_drafts_torch(
    last_tokens: torch.Tensor,
    drafts: torch.Tensor,
    k_hat: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference packing.

    Args:
        last_tokens: [B] int64, last committed token of each request.
        drafts: [B, K-1] int64, draft tokens (only the first k_hat[b]-1 are used).
        k_hat: [B] int64, verify length per request, 1 <= k_hat <= K.
        seq_lens: [B] int64, position of the last committed token.
        num_tokens: T = sum(k_hat) if known (avoids a device sync).
    Returns:
        token_ids: [T] int64, positions: [T] int64, cu_seqlens: [B+1] int64.
    """
    cu_seqlens = cu_seqlens_from_lengths(k_hat)
    T = _num_tokens(cu_seqlens, num_tokens)
    seg, local = token_segments(cu_seqlens, T)
    token_ids = last_tokens[seg]
    if drafts.shape[1] > 0:
        from_drafts = drafts[seg, (local - 1).clamp(min=0)]
        token_ids = torch.where(local == 0, token_ids, from_drafts)
    positions = seq_lens[seg] + local
    return token_ids.to(torch.int64), positions.to(torch.int64), cu_seqlens


@triton.jit
def _pack_drafts_kernel(
    last_tokens_ptr,  # [B]
    drafts_ptr,  # [B, K-1]
    drafts_stride,
    k_hat_ptr,  # [B]
    seq_lens_ptr,  # [B]
    cu_seqlens_ptr,  # [B+1]
    token_ids_ptr,  # [T] out
    positions_ptr,  # [T] out
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + b)
    k = tl.load(k_hat_ptr + b).to(tl.int32)
    last = tl.load(last_tokens_ptr + b)
    base_pos = tl.load(seq_lens_ptr + b)
    draft_row = drafts_ptr + b.to(tl.int64) * drafts_stride
    for off in range(0, k, BLOCK_K):
        i = off + tl.arange(0, BLOCK_K)
        in_seg = i < k
        # Offset i > 0 holds draft i-1; offset 0 holds the last committed token.
        draft = tl.load(draft_row + (i - 1), mask=in_seg & (i > 0), other=0)
        tok = tl.where(i == 0, last, draft)
        tl.store(token_ids_ptr + start + i, tok.to(tl.int64), mask=in_seg)
        tl.store(positions_ptr + start + i, (base_pos + i).to(tl.int64), mask=in_seg)


def pack_drafts_triton(
    last_tokens: torch.Tensor,
    drafts: torch.Tensor,
    k_hat: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton packing; same contract as ``pack_drafts_torch``. One program per request."""
    num_reqs = k_hat.numel()
    cu_seqlens = cu_seqlens_from_lengths(k_hat)
    T = _num_tokens(cu_seqlens, num_tokens)
    token_ids = torch.empty(T, dtype=torch.int64, device=k_hat.device)
    positions = torch.empty(T, dtype=torch.int64, device=k_hat.device)
    if num_reqs == 0:
        return token_ids, positions, cu_seqlens
    if drafts.shape[1] == 0:
        # No draft columns: keep a valid pointer; every draft load is masked off (k_hat == 1).
        drafts = drafts.new_zeros(num_reqs, 1)
    _pack_drafts_kernel[(num_reqs,)](
        last_tokens.contiguous(),
        drafts,
        drafts.stride(0),
        k_hat.contiguous(),
        seq_lens.contiguous(),
        cu_seqlens,
        token_ids,
        positions,
        BLOCK_K=_PACK_BLOCK,
    )
    return token_ids, positions, cu_seqlens


def draft_prob_rows(cu_seqlens: torch.Tensor, num_drafts: int, num_tokens: int | None = None) -> torch.Tensor:
    """Gather index from stream rows into drafter probabilities.

    Stream row j = cu_seqlens[b] + i (i < k_hat[b] - 1) scores draft token i+1 of request
    b, drawn from ``draft_probs[b, i]``; that is row ``b * num_drafts + i`` of
    ``draft_probs.reshape(B * num_drafts, V)``. The last row of each segment has no draft
    token after it and maps to -1.

    Args:
        cu_seqlens: [B+1] int64.
        num_drafts: K-1, the second dimension of ``drafts`` / ``draft_probs``.
    Returns:
        [T] int64 row index, -1 on each segment's last row.
    """
    T = _num_tokens(cu_seqlens, num_tokens)
    seg, local = token_segments(cu_seqlens, T)
    is_last = cu_seqlens[seg + 1] - 1 == torch.arange(T, device=cu_seqlens.device)
    rows = seg * num_drafts + local
    return torch.where(is_last, torch.full_like(rows, -1), rows)


def pack_draft_probs(
    draft_probs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int | None = None
) -> torch.Tensor:
    """Lay drafter probabilities out along the verify stream.

    Args:
        draft_probs: [B, K-1, V], ``draft_probs[b, i]`` is the distribution draft i was drawn from.
        cu_seqlens: [B+1] int64 from ``pack_drafts``.
    Returns:
        [T, V] in draft_probs' dtype; each segment's last row is zero (unused by verification).
    """
    num_reqs, num_drafts, vocab = draft_probs.shape
    rows = draft_prob_rows(cu_seqlens, num_drafts, num_tokens)
    if num_drafts == 0:
        return draft_probs.new_zeros(rows.numel(), vocab)
    flat = draft_probs.reshape(num_reqs * num_drafts, vocab)
    gathered = flat.index_select(0, rows.clamp(min=0))
    return torch.where((rows >= 0)[:, None], gathered, torch.zeros((), dtype=flat.dtype, device=flat.device))
