"""Where a training block starts: the anchors of one sequence, for the online learner and
offline training alike.

A block anchored at position a starts from the known token at a and drafts a+1 .. a+k-1,
so an anchor needs a next token (a <= length - 2). Anchors run over the answer (the
target itself supplies the first answer token at prefill, so the first block is
anchored on it) and never before position 1 (position 0 has no context).
"""

from __future__ import annotations

import torch


def sample_anchors(first: int, length: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchors in [max(1, first), length - 2], sorted: [A] int64 (A = 0 when
    the range is empty)."""
    lo, hi = max(1, first), length - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.int64)
    span = hi - lo + 1
    pick = torch.randperm(span, generator=gen)[: min(n, span)] + lo
    return pick.sort().values
