"""Torch helpers for a packed verify stream (shared by the reference implementations).

A stream packs B requests back to back; request b owns rows [cu_seqlens[b],
cu_seqlens[b + 1]) of every per-token tensor.
"""

from __future__ import annotations

import torch


def token_segments(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request id and offset inside its segment for every stream token.

    Args:
        cu_seqlens: [B+1] int64, cu_seqlens[0] == 0.
        num_tokens: T == cu_seqlens[-1].
    Returns:
        seg: [T] int64, request owning each token.
        local: [T] int64, offset of each token inside its segment (0 = last committed token).
    """
    num_reqs = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.repeat_interleave(
        torch.arange(num_reqs, device=cu_seqlens.device), lengths, output_size=num_tokens
    )
    local = torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[seg]
    return seg, local


def first_true_per_segment(
    flags: torch.Tensor, seg: torch.Tensor, local: torch.Tensor, default: torch.Tensor
) -> torch.Tensor:
    """Smallest local offset whose flag is set, per request; ``default`` where none is.

    Args:
        flags: [T] bool.
        seg, local: [T] int64 from ``token_segments``.
        default: [B] int64, returned for requests with no flag set (must be <= any offset
            that could be flagged for the result to be meaningful as "stop here").
    Returns:
        [B] int64.
    """
    big = torch.iinfo(torch.int64).max
    candidates = torch.where(flags, local, torch.full_like(local, big))
    return default.clone().scatter_reduce_(0, seg, candidates, reduce="amin", include_self=True)


def expand_to_tokens(per_request: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Repeat a per-request value over the request's stream rows: [B, ...] -> [T, ...]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(per_request.device)
    return torch.repeat_interleave(per_request, lengths, dim=0, output_size=num_tokens)
