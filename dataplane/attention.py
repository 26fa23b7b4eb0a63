"""Attention over a packed stream of requests, each with its own cached prefix.

The projections of every request run as one matrix product over the flat stream;
only the score computation is per request, because each attends to a different
prefix. Few queries (decoding, verification, drafting) go through two batched matrix
products and a softmax (``attend_small``): on CPU, PyTorch's fused attention kernel
spends far more on setting up its threads than on a handful of query rows (measured
here: 1 query over 200 keys, 24 ms against 41 us when the cores are busy), which made
that loop the largest cost of a decode step with many requests. Long prompts keep the
fused kernel, which never materialises the n x L score matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_offset_mask(n: int, total: int, device: torch.device) -> torch.Tensor:
    """Bool mask [n, total]: query i (at absolute position total-n+i) sees keys j <= total-n+i."""
    q_pos = torch.arange(total - n, total, device=device).unsqueeze(1)
    k_pos = torch.arange(total, device=device).unsqueeze(0)
    return k_pos <= q_pos


SMALL_QUERIES = 64  # at most this many queries: attend_small


def additive_mask(see: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility ``see`` -> an additive mask of the same shape: 0 where seen, -inf elsewhere."""
    return torch.zeros(see.shape, dtype=dtype, device=see.device).masked_fill_(~see, float("-inf"))


def offset_mask(n: int, total: int, group: int, kv_heads: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive causal mask [kv_heads, n * group, total] (an expanded view), 0 or -inf.

    Rows in (query, head-in-group) order, as ``attend_few`` lays out the queries; query i
    sits at position total - n + i and sees the keys up to it. Built once per forward and
    shared by every layer (``packed_attention.StreamPlan``).
    """
    see = causal_offset_mask(n, total, device).repeat_interleave(group, dim=0)  # [n*g, total]
    return additive_mask(see, dtype).unsqueeze(0).expand(kv_heads, n * group, total)


def attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Few-query attention by explicit scores: two batched products and a softmax.

    q [n, heads, d]; k, v [kv_heads, L, d]; mask: additive [kv_heads, n * g, L]
    (``offset_mask``) or None (every key visible). Query head h reads kv head
    h // (heads / kv_heads) (GQA). Scaling and masking ride on the first product
    (``baddbmm``), so a verify step costs three kernels per layer. Returns [n, heads, d].
    """
    n, heads, d = q.shape
    kvh = k.shape[0]
    g = heads // kvh
    qh = q.reshape(n, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, n * g, d)  # [kvh, n*g, d]
    if mask is None:
        scores = torch.bmm(qh, k.transpose(1, 2)) * (d ** -0.5)  # [kvh, n*g, L]
    else:
        scores = torch.baddbmm(mask, qh, k.transpose(1, 2), alpha=d ** -0.5)
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [kvh, n*g, d]
    return out.reshape(kvh, n, g, d).permute(1, 0, 2, 3).reshape(n, heads, d)


def attend_small(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None) -> torch.Tensor:
    """Reference-equivalent attention by explicit scores, for few queries (``attend_few``).

    Shapes and mask as ``attend``: with ``causal``, query i sits at position total - n + i
    of all total keys (extra keys included) and sees the keys up to it.
    """
    n, heads, _ = q.shape
    if extra_k is not None:
        k = torch.cat([k, extra_k], dim=1)
        v = torch.cat([v, extra_v], dim=1)
    mask = None
    if causal and n > 1:
        mask = offset_mask(n, k.shape[1], heads // k.shape[0], k.shape[0], q.dtype, q.device)
    return attend_few(q, k, v, mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None) -> torch.Tensor:
    """One request's attention.

    q [n, heads, d]; k, v [kv_heads, L, d] (a cache view, L includes the n new keys when
    ``causal``); extra_k/extra_v [kv_heads, m, d] are appended keys seen by every query
    (the drafter's block). Returns [n, heads, d].
    """
    n, heads, d = q.shape
    if n <= SMALL_QUERIES:
        return attend_small(q, k, v, causal, extra_k, extra_v)
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
