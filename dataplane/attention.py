"""Attention over a packed stream of requests, each with its own cached prefix.

The projections of every request run as one matrix product over the flat stream;
only the score computation is per request, because each attends to a different
prefix. On CPU that loop costs far less than the projections it sits between.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_offset_mask(n: int, total: int, device: torch.device) -> torch.Tensor:
    """Bool mask [n, total]: query i (at absolute position total-n+i) sees keys j <= total-n+i."""
    q_pos = torch.arange(total - n, total, device=device).unsqueeze(1)
    k_pos = torch.arange(total, device=device).unsqueeze(0)
    return k_pos <= q_pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None) -> torch.Tensor:
    """One request's attention.

    q [n, heads, d]; k, v [kv_heads, L, d] (a cache view, L includes the n new keys when
    ``causal``); extra_k/extra_v [kv_heads, m, d] are appended keys seen by every query
    (the drafter's block). Returns [n, heads, d].
    """
    n, heads, d = q.shape
    if extra_k is not None:
        k = torch.cat([k, extra_k], dim=1)
        v = torch.cat([v, extra_v], dim=1)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, kv_heads, L, d]
    mask = None
    if causal and n > 1:
        mask = causal_offset_mask(n, k.shape[1], q.device)
    gqa = heads != k.shape[0]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)
