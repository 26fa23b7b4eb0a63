"""Greedy verification of a packed stream.

For request b with segment [s, e): draft token x_{s+1+i} is kept while it equals
argmax(logits[s+i]); ``accepted[b]`` counts the kept prefix and ``bonus[b]`` is the
target's argmax at the first mismatch (or after the last draft when all are kept),
i.e. argmax(logits[s + accepted[b]]). Argmax ties go to the lowest index, as in
``torch.argmax``. NaN logits are not supported (torch.argmax treats NaN as the
maximum; the Triton kernel never selects it).
"""

from __future__ import annotations

import torch

from dataplane.kernels._triton import tl, triton
from dataplane.kernels.segments import first_true_per_segment, token_segments

_ARGMAX_BLOCK_V = 1024  # vocabulary entries per loop step of the argmax kernel
_ACCEPT_BLOCK_K = 32  # stream rows per loop step of the acceptance kernel


def greedy_accept_torch(
    logits: torch.Tensor, token_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference greedy acceptance.

    Args:
        logits: [T, V] target logits, row j scores the token after x_j.
        token_ids: [T] int64 packed stream.
        cu_seqlens: [B+1] int64.
    Returns:
        accepted: [B] int64 in [0, k_hat-1]; bonus: [B] int64 token id.
    """
    T = token_ids.numel()
    # max(dim).indices is the first maximal index, like argmax, and on CPU it reads a row of
    # 49152 bfloat16 logits about 4x faster than argmax does.
    argmax = logits.max(dim=-1).indices  # [T]
    seg, local = token_segments(cu_seqlens, T)
    num_drafts = cu_seqlens[1:] - cu_seqlens[:-1] - 1  # [B]
    is_draft_row = local < num_drafts[seg]
    # The last stream token wraps around; it is never a draft row, so the value is unused.
    next_tokens = torch.roll(token_ids, shifts=-1)
    mismatch = is_draft_row & (argmax != next_tokens)
    accepted = first_true_per_segment(mismatch, seg, local, num_drafts)
    bonus = argmax[cu_seqlens[:-1] + accepted]
    return accepted, bonus


@triton.jit
def _row_argmax_kernel(
    logits_ptr,  # [T, V]
    logits_stride,
    argmax_ptr,  # [T] out, int64
    V,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        blk_val, blk_idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: on a tie the earlier block (lower index) keeps the win.
        better = blk_val > best_val
        best_idx = tl.where(better, start + blk_idx, best_idx)
        best_val = tl.where(better, blk_val, best_val)
    tl.store(argmax_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _greedy_accept_kernel(
    argmax_ptr,  # [T]
    token_ids_ptr,  # [T]
    cu_seqlens_ptr,  # [B+1]
    accepted_ptr,  # [B] out
    bonus_ptr,  # [B] out
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + b)
    end = tl.load(cu_seqlens_ptr + b + 1)
    num_drafts = (end - start - 1).to(tl.int32)
    first_reject = num_drafts
    for off in range(0, num_drafts, BLOCK_K):
        i = off + tl.arange(0, BLOCK_K)
        is_draft = i < num_drafts
        target = tl.load(argmax_ptr + start + i, mask=is_draft, other=0)
        draft = tl.load(token_ids_ptr + start + 1 + i, mask=is_draft, other=0)
        reject_at = tl.where(is_draft & (target != draft), i, num_drafts)
        first_reject = tl.minimum(first_reject, tl.min(reject_at, axis=0))
    tl.store(accepted_ptr + b, first_reject.to(tl.int64))
    tl.store(bonus_ptr + b, tl.load(argmax_ptr + start + first_reject))


def row_argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """[T, V] float -> [T] int64 argmax per row (lowest index on ties)."""
    T, V = logits.shape
    argmax = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return argmax
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_v = min(_ARGMAX_BLOCK_V, triton.next_power_of_2(V))
    _row_argmax_kernel[(T,)](logits, logits.stride(0), argmax, V, BLOCK_V=block_v)
    return argmax


def greedy_accept_triton(
    logits: torch.Tensor, token_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton greedy acceptance; same contract as ``greedy_accept_torch``.

    Two launches: a row argmax over vocabulary blocks (one program per stream row), then
    the prefix match (one program per request).
    """
    num_reqs = cu_seqlens.numel() - 1
    argmax = row_argmax_triton(logits)
    accepted = torch.empty(num_reqs, dtype=torch.int64, device=logits.device)
    bonus = torch.empty(num_reqs, dtype=torch.int64, device=logits.device)
    if num_reqs == 0:
        return accepted, bonus
    _greedy_accept_kernel[(num_reqs,)](
        argmax, token_ids.contiguous(), cu_seqlens.contiguous(), accepted, bonus, BLOCK_K=_ACCEPT_BLOCK_K
    )
    return accepted, bonus
