"""The AVX512-BF16 GEMM kernel (dataplane/kernels/gemm_dpbf16.c) against its torch reference,
and the plan of which kernel serves how many rows: AMX where it pays, else this kernel where
it pays (also for one to four rows where it beats the GEMV), else the GEMV and oneDNN."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_amx, cpu_dpbf16, cpu_gemv, cpu_gemv_f32, cpu_linear
from dataplane.kernels.cpu_linear import KernelPlan, PackedLinear, kernel_plan, linear_torch
from dataplane.precision import cpu_flags

HAS_BF16 = "avx512_bf16" in cpu_flags()


def test_available_exactly_where_the_cpu_has_avx512_bf16():
    # an AVX2-only CPU must never load it; every AVX512-BF16 CPU (with gcc) must
    assert cpu_dpbf16.available() == HAS_BF16


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 33, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(112, 96), (16, 32), (48, 64), (80, 64), (960, 576), (576, 1536)])
def test_kernel_equals_reference(m, n, k):
    if not cpu_dpbf16.available():
        assert not HAS_BF16
        return
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = cpu_dpbf16.gemm(x, cpu_amx.pack(w))
    ref = cpu_gemv.gemv_torch(x, w)
    assert got.shape == ref.shape
    # float32 accumulation in another order, one bf16 rounding: at most one bf16 step apart
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_covers_every_column(threads):
    if not cpu_dpbf16.available():
        return
    g = torch.Generator().manual_seed(threads)
    w = (torch.randn(7 * 16, 64, generator=g) * 0.1).to(torch.bfloat16)  # 7 blocks: shares of 2/3/4, tails of 1-2
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_dpbf16.gemm(x, cpu_amx.pack(w))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.float(), cpu_gemv.gemv_torch(x, w).float(), atol=1e-2, rtol=8e-3)


def test_strided_rows_and_refusals():
    if not cpu_dpbf16.available():
        return
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(20, 128, generator=g).to(torch.bfloat16)[:, :64]  # rows with a stride of 128
    torch.testing.assert_close(cpu_dpbf16.gemm(x, cpu_amx.pack(w)).float(), cpu_gemv.gemv_torch(x, w).float(),
                               atol=1e-2, rtol=8e-3)
    with pytest.raises(ValueError):
        cpu_dpbf16.gemm(torch.randn(2, 32).to(torch.bfloat16), cpu_amx.pack(w))  # K does not match
    with pytest.raises(ValueError):
        cpu_dpbf16.gemm(torch.randn(2, 64), cpu_amx.pack(w))  # float32 rows


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 48, 300])
def test_packed_linear_routes_rows_as_the_plan_says(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(320, 576, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w)
    plan = kernel_plan()
    assert lin.tiled is plan.tiled and lin.gemv == plan.gemv
    calls = []
    real = cpu_dpbf16.gemm
    monkeypatch.setattr(cpu_dpbf16, "gemm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    got = lin(x)
    by_gemv = lin.gemv and rows <= cpu_gemv.MAX_ROWS
    ours = lin.tiled is cpu_dpbf16 and not by_gemv and rows <= cpu_dpbf16.MAX_ROWS
    assert calls == ([rows] if ours else [])
    torch.testing.assert_close(got.float(), linear_torch(x, w).float(), atol=2e-2, rtol=1e-2)


def test_plan_on_this_machine():
    plan = kernel_plan()
    if cpu_amx.pays():
        assert plan.tiled is cpu_amx
    elif cpu_dpbf16.pays():
        assert plan.tiled is cpu_dpbf16
        assert plan.gemv == (cpu_gemv.pays() and not cpu_dpbf16.serves_one_row())
    else:
        assert plan.tiled is None and plan.gemv == cpu_gemv.pays()
    if not HAS_BF16:  # an AVX2-only machine: no bfloat16 kernel; float32 through the AVX2 kernel where it pays
        assert (plan.gemv, plan.tiled) == (False, None)
    assert plan.gemv_f32 == cpu_gemv_f32.pays()


@pytest.mark.parametrize(("amx", "dp", "one_row", "gemv", "want"), [
    (True, True, True, True, KernelPlan(gemv=True, tiled=cpu_amx)),
    (False, True, True, True, KernelPlan(gemv=False, tiled=cpu_dpbf16)),
    (False, True, False, True, KernelPlan(gemv=True, tiled=cpu_dpbf16)),
    (False, False, False, True, KernelPlan(gemv=True, tiled=None)),
    (False, False, False, False, KernelPlan(gemv=False, tiled=None)),
])
def test_plan_prefers_amx_then_avx512_bf16_and_drops_the_gemv_it_beats(amx, dp, one_row, gemv, want, monkeypatch):
    monkeypatch.setattr(cpu_amx, "pays", lambda: amx)
    monkeypatch.setattr(cpu_dpbf16, "pays", lambda: dp)
    monkeypatch.setattr(cpu_dpbf16, "serves_one_row", lambda: one_row)
    monkeypatch.setattr(cpu_gemv, "pays", lambda: gemv)
    monkeypatch.setattr(cpu_gemv_f32, "pays", lambda: False)
    assert cpu_linear.kernel_plan.__wrapped__() == want
    described = want.describe()
    assert described["tiled_rows"] == (None if want.tiled is None else f"{5 if want.gemv else 1}-256")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_dpbf16.ENV_SWITCH, "0")
    cpu_dpbf16._lib.cache_clear()
    try:
        assert cpu_dpbf16._lib() is None
    finally:
        cpu_dpbf16._lib.cache_clear()
