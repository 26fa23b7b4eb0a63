"""Few-query attention by explicit scores equals PyTorch's fused attention (the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dataplane.attention import SMALL_QUERIES, attend, attend_small, causal_offset_mask


def _reference(q, k, v, causal, extra_k=None, extra_v=None):
    """float64 SDPA with the same mask semantics (query i at position total - n + i)."""
    if extra_k is not None:
        k, v = torch.cat([k, extra_k], 1), torch.cat([v, extra_v], 1)
    n = q.shape[0]
    mask = causal_offset_mask(n, k.shape[1], q.device) if causal and n > 1 else None
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double()[None], v.double()[None],
                                         attn_mask=mask, enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("n", [1, 2, 7, 17, SMALL_QUERIES])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("extra", [0, 5])
def test_attend_small_equals_fused_reference(n, heads, kv_heads, causal, extra):
    g = torch.Generator().manual_seed(n * 100 + heads + extra)
    L, d = n + 23, 16
    q = torch.randn(n, heads, d, generator=g)
    k, v = torch.randn(kv_heads, L, d, generator=g), torch.randn(kv_heads, L, d, generator=g)
    ek = torch.randn(kv_heads, extra, d, generator=g) if extra else None
    ev = torch.randn(kv_heads, extra, d, generator=g) if extra else None
    ref = _reference(q, k, v, causal, ek, ev)
    got = attend_small(q, k, v, causal, ek, ev)
    assert got.shape == (n, heads, d)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(attend(q, k, v, causal, ek, ev).double(), ref, atol=2e-6, rtol=1e-5)


def test_long_queries_take_the_fused_kernel_and_agree():
    g = torch.Generator().manual_seed(1)
    n = SMALL_QUERIES + 9
    q, k, v = torch.randn(n, 6, 8, generator=g), torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g)
    torch.testing.assert_close(attend(q, k, v, True).double(), _reference(q, k, v, True), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(attend_small(q, k, v, True), attend(q, k, v, True), atol=2e-6, rtol=1e-5)
