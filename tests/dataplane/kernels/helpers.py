"""Shared builders for verify-stream tests: random packed streams and naive oracles."""

from __future__ import annotations

import os

import pytest
import torch

from dataplane.kernels import HAS_TRITON, cu_seqlens_from_lengths

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Triton kernels run on a GPU, or on CPU through the interpreter (TRITON_INTERPRET=1).
requires_triton = pytest.mark.skipif(
    not HAS_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_k_hat(num_reqs: int, max_k: int, g: torch.Generator) -> torch.Tensor:
    """[B] int64 verify lengths in [1, max_k]."""
    return torch.randint(1, max_k + 1, (num_reqs,), generator=g)


def stream_layout(k_hat: torch.Tensor) -> tuple[torch.Tensor, int]:
    cu = cu_seqlens_from_lengths(k_hat)
    return cu, int(cu[-1])


def segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:], strict=True))


def to_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]
