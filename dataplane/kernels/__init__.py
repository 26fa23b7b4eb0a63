"""Verification kernels for a packed verify stream.

Each op has a plain PyTorch reference (``*_torch``) and a Triton kernel (``*_triton``)
with the same contract. The functions exported here pick one per call: Triton when the
inputs live on CUDA (or ``ADAFLASH_FORCE_TRITON=1``, used with ``TRITON_INTERPRET=1`` to
run the kernels on CPU), PyTorch otherwise. Index tensors (token ids, lengths, cu_seqlens)
follow the op's main tensor to its device, so a caller may build them on the host.

Stream conventions: B requests, request b verifies k_hat[b] >= 1 tokens; T = sum(k_hat);
``cu_seqlens`` [B+1] int64 with cu_seqlens[0] = 0; request b owns rows [s, e) =
[cu_seqlens[b], cu_seqlens[b+1]). x_s is its last committed token, x_{s+1..e-1} its
drafts; target row j scores the token after x_j; draft row j (j < e-1) is the
distribution x_{j+1} was drawn from.
"""

from __future__ import annotations

import os

import torch

from dataplane.kernels._triton import HAS_TRITON
from dataplane.kernels.greedy import greedy_accept_torch, greedy_accept_triton
from dataplane.kernels.pack import (
    cu_seqlens_from_lengths,
    draft_prob_rows,
    pack_draft_probs,
    pack_drafts_torch,
    pack_drafts_triton,
)
from dataplane.kernels.rejection import (
    rejection_accept_torch,
    rejection_accept_triton,
    sample_inverse_cdf,
)

FORCE_TRITON_ENV = "ADAFLASH_FORCE_TRITON"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should handle an op whose inputs live with ``tensor``."""
    if os.environ.get(FORCE_TRITON_ENV, "") == "1":
        if not HAS_TRITON:
            raise RuntimeError(f"{FORCE_TRITON_ENV}=1 but triton cannot be imported")
        return True
    return HAS_TRITON and tensor.is_cuda


def pack_drafts(
    last_tokens: torch.Tensor,
    drafts: torch.Tensor,
    k_hat: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B], [B, K-1], [B], [B] -> token_ids [T], positions [T], cu_seqlens [B+1] (all int64)."""
    impl = pack_drafts_triton if use_triton(k_hat) else pack_drafts_torch
    dev = k_hat.device
    return impl(last_tokens.to(dev), drafts.to(dev), k_hat, seq_lens.to(dev), num_tokens)


def greedy_accept(
    logits: torch.Tensor, token_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V], token_ids [T], cu_seqlens [B+1] -> accepted [B], bonus [B] (int64)."""
    impl = greedy_accept_triton if use_triton(logits) else greedy_accept_torch
    return impl(logits, token_ids.to(logits.device), cu_seqlens.to(logits.device))


def rejection_accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """p [T, V], q [T, V], token_ids [T], cu_seqlens [B+1], uniforms [T], bonus_uniforms [B]
    -> accepted [B], bonus [B] (int64)."""
    impl = rejection_accept_triton if use_triton(target_probs) else rejection_accept_torch
    dev = target_probs.device
    return impl(target_probs, draft_probs.to(dev), token_ids.to(dev), cu_seqlens.to(dev), uniforms.to(dev),
                bonus_uniforms.to(dev))


__all__ = [
    "FORCE_TRITON_ENV",
    "HAS_TRITON",
    "cu_seqlens_from_lengths",
    "draft_prob_rows",
    "greedy_accept",
    "greedy_accept_torch",
    "greedy_accept_triton",
    "pack_draft_probs",
    "pack_drafts",
    "pack_drafts_torch",
    "pack_drafts_triton",
    "rejection_accept",
    "rejection_accept_torch",
    "rejection_accept_triton",
    "sample_inverse_cdf",
    "use_triton",
]
