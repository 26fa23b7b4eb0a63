"""The AMX bfloat16 kernel (dataplane/kernels/gemm_amx.c) against its torch reference, its
weight layout, and the choice of path: it serves verify-sized products only where the CPU
has AMX-BF16 and it measured faster; everywhere else the GEMV kernel, oneDNN or F.linear serve."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_amx, cpu_gemv
from dataplane.kernels.cpu_linear import PackedLinear, linear_torch
from dataplane.precision import cpu_flags

HAS_AMX = {"amx_bf16", "amx_tile"} <= set(cpu_flags())


def test_available_exactly_where_the_cpu_has_amx():
    # a CPU without AMX (AVX2-only, or AMD with AVX512-BF16) must never load it
    assert cpu_amx.available() == HAS_AMX


def test_pack_lays_out_b_tiles():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    p = cpu_amx.pack(w)
    assert p.shape == (2, 2, 16, 16, 2)
    for nb, kb, r, c, j in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1), (1, 0, 9, 2, 0)]:
        assert p[nb, kb, r, c, j] == w[16 * nb + c, 32 * kb + 2 * r + j]


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(112, 96), (16, 32), (960, 576), (576, 1536)])
def test_kernel_equals_reference(m, n, k):
    if not cpu_amx.available():
        assert not HAS_AMX
        return
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = cpu_amx.gemm(x, cpu_amx.pack(w))
    ref = cpu_gemv.gemv_torch(x, w)
    assert got.shape == ref.shape
    # float32 accumulation in another order, one bf16 rounding: at most one bf16 step apart
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=8e-3)


def test_strided_rows_and_refusals():
    if not cpu_amx.available():
        return
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(20, 128, generator=g).to(torch.bfloat16)[:, :64]  # rows with a stride of 128
    torch.testing.assert_close(cpu_amx.gemm(x, cpu_amx.pack(w)).float(), cpu_gemv.gemv_torch(x, w).float(),
                               atol=1e-2, rtol=8e-3)
    assert not cpu_amx.takes_weight(torch.randn(24, 64).to(torch.bfloat16))  # N not a multiple of 16
    assert not cpu_amx.takes_weight(torch.randn(32, 48).to(torch.bfloat16))  # K not a multiple of 32
    assert not cpu_amx.takes_weight(torch.randn(32, 64))  # float32
    with pytest.raises(ValueError):
        cpu_amx.gemm(torch.randn(2, 32).to(torch.bfloat16), cpu_amx.pack(w))  # K does not match


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 48])
def test_packed_linear_routes_verify_rows_through_the_kernel_where_it_pays(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(320, 576, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w)
    assert (lin.tiled is cpu_amx) == cpu_amx.pays()
    calls = []
    real = cpu_amx.gemm
    monkeypatch.setattr(cpu_amx, "gemm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    got = lin(x)
    by_gemv = lin.gemv and rows <= cpu_gemv.MAX_ROWS
    assert calls == ([rows] if lin.tiled is cpu_amx and not by_gemv else [])
    torch.testing.assert_close(got.float(), linear_torch(x, w).float(), atol=2e-2, rtol=1e-2)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_amx.ENV_SWITCH, "0")
    cpu_amx._lib.cache_clear()
    try:
        assert cpu_amx._lib() is None
    finally:
        cpu_amx._lib.cache_clear()
