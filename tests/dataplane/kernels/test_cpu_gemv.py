"""The bfloat16 streaming GEMV kernel (dataplane/kernels/gemv_bf16.c) against its torch
reference, and the choice of path: it serves one to four rows only where the CPU has
AVX512-BF16 and it measured faster; everywhere else oneDNN (or F.linear) serves."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_gemv
from dataplane.kernels.cpu_linear import PackedLinear, kernel_plan, linear_torch
from dataplane.precision import cpu_flags

HAS_BF16 = "avx512_bf16" in cpu_flags()


def test_available_exactly_where_the_cpu_has_avx512_bf16():
    # an AVX2-only machine must never load it; an AVX512-BF16 machine with gcc must
    assert cpu_gemv.available() == HAS_BF16


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(203, 96), (8, 32), (1537, 576), (576, 1536)])
def test_kernel_equals_reference(m, n, k):
    if not cpu_gemv.available():
        assert not HAS_BF16
        return
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = cpu_gemv.gemv(x, w)
    ref = cpu_gemv.gemv_torch(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # the same float32 products summed in another order: within one bf16 rounding of the output
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=8e-3)


def test_strided_rows_and_refusals():
    if not cpu_gemv.available():
        return
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=g) * 0.1).to(torch.bfloat16)
    big = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    x = big[:, :64]  # rows with a stride of 128
    assert cpu_gemv.supported(x, w)
    torch.testing.assert_close(cpu_gemv.gemv(x, w).float(), cpu_gemv.gemv_torch(x, w).float(), atol=1e-2, rtol=8e-3)
    assert not cpu_gemv.supported(torch.randn(5, 64).to(torch.bfloat16), w)  # more than four rows
    assert not cpu_gemv.supported(torch.randn(1, 48).to(torch.bfloat16), torch.randn(8, 48).to(torch.bfloat16))
    with pytest.raises(ValueError):
        cpu_gemv.gemv(torch.randn(1, 48).to(torch.bfloat16), torch.randn(8, 48).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 4, 5, 16])
def test_packed_linear_routes_few_rows_through_the_kernel_where_it_pays(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(320, 576, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w)
    assert lin.gemv == kernel_plan().gemv
    calls = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    got = lin(x)
    assert calls == ([rows] if lin.gemv and rows <= cpu_gemv.MAX_ROWS else [])
    torch.testing.assert_close(got.float(), linear_torch(x, w).float(), atol=2e-2, rtol=1e-2)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_gemv.ENV_SWITCH, "0")
    cpu_gemv._lib.cache_clear()
    try:
        assert cpu_gemv._lib() is None
    finally:
        cpu_gemv._lib.cache_clear()


def test_a_verdict_measured_on_a_quiet_machine_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setitem(cpu_gemv._CACHE, "dir", tmp_path)
    monkeypatch.setattr(cpu_gemv, "machine_busy", lambda: False)
    calls = []

    def measure(answer):
        return lambda: calls.append(answer) or answer

    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, measure(True)) is True
    # the next start reads the kept verdict back instead of measuring (which would say False now)
    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, measure(False)) is True
    assert calls == [True]
    path = cpu_gemv.verdict_file(cpu_gemv.SOURCE)
    assert path.parent == tmp_path / "verdicts" and path.is_file()
    # another kernel source has its own verdict
    other = tmp_path / "other_kernel.c"
    other.write_text("int f(void) { return 0; }\n")
    assert cpu_gemv.kept_verdict(other, measure(False)) is False
    assert calls == [True, False]
    # an unreadable verdict is measured again and replaced
    path.write_text("{not json")
    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, measure(False)) is False
    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, measure(True)) is False
    assert calls == [True, False, False]


def test_a_verdict_measured_on_a_busy_machine_holds_for_this_process_only(tmp_path, monkeypatch):
    monkeypatch.setitem(cpu_gemv._CACHE, "dir", tmp_path)
    monkeypatch.setattr(cpu_gemv, "machine_busy", lambda: True)
    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, lambda: True) is True
    assert not cpu_gemv.verdict_file(cpu_gemv.SOURCE).exists()
    assert cpu_gemv.kept_verdict(cpu_gemv.SOURCE, lambda: False) is False
