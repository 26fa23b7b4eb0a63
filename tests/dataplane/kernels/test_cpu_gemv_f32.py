"""The float32 AVX2 GEMV kernel (dataplane/kernels/gemv_f32.c) against its torch reference:
one to 128 rows, each row's result independent of the rows beside it, and the choice of
path: it serves float32 products only where the CPU has AVX2 and FMA and it measured
faster than MKL; everywhere else ``F.linear`` serves."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_gemv_f32
from dataplane.kernels.cpu_linear import PackedLinear, kernel_plan, linear_torch
from dataplane.precision import cpu_flags

HAS_AVX2 = {"avx2", "fma"} <= set(cpu_flags())


def test_available_exactly_where_the_cpu_has_avx2_and_fma():
    assert cpu_gemv_f32.available() == HAS_AVX2


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, 128])
@pytest.mark.parametrize(("n", "k"), [(203, 96), (7, 8), (1537, 576), (576, 1536)])
def test_kernel_equals_reference(m, n, k):
    if not cpu_gemv_f32.available():
        assert not HAS_AVX2
        return
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    got = cpu_gemv_f32.gemv(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # the same float32 products summed in another order
    torch.testing.assert_close(got, cpu_gemv_f32.gemv_torch(x, w), atol=1e-4, rtol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Decode (one row) and verify (several) must compute a row bit for bit alike."""
    if not cpu_gemv_f32.available():
        return
    g = torch.Generator().manual_seed(1)
    w = torch.randn(333, 576, generator=g) * 0.05
    x = torch.randn(64, 576, generator=g)
    alone = torch.cat([cpu_gemv_f32.gemv(x[i : i + 1], w) for i in range(64)])
    for m in (2, 3, 4, 7, 16, 64):
        assert torch.equal(cpu_gemv_f32.gemv(x[:m], w), alone[:m]), m


def test_strided_rows_and_refusals():
    if not cpu_gemv_f32.available():
        return
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g) * 0.1
    x = torch.randn(4, 128, generator=g)[:, :64]  # rows with a stride of 128
    assert cpu_gemv_f32.supported(x, w)
    torch.testing.assert_close(cpu_gemv_f32.gemv(x, w), cpu_gemv_f32.gemv_torch(x, w), atol=1e-4, rtol=1e-4)
    assert not cpu_gemv_f32.supported(torch.randn(129, 64), w)  # more rows than it serves
    assert not cpu_gemv_f32.supported(torch.randn(1, 12), torch.randn(8, 12))  # K not a multiple of 8
    assert not cpu_gemv_f32.supported(torch.randn(1, 64).to(torch.bfloat16), w)
    with pytest.raises(ValueError):
        cpu_gemv_f32.gemv(torch.randn(1, 12), torch.randn(8, 12))


@pytest.mark.parametrize("rows", [1, 4, 16, 128, 129])
def test_packed_linear_routes_float32_rows_through_the_kernel_where_it_pays(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 576, generator=g) * 0.05
    x = torch.randn(rows, 576, generator=g)
    lin = PackedLinear(w)
    assert lin.gemv_f32 == kernel_plan().gemv_f32 == (cpu_gemv_f32.pays())
    calls = []
    real = cpu_gemv_f32.gemv
    monkeypatch.setattr(cpu_gemv_f32, "gemv", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    got = lin(x.view(1, rows, 576))
    assert got.shape == (1, rows, 320)
    assert calls == ([rows] if lin.gemv_f32 and rows <= cpu_gemv_f32.MAX_ROWS else [])
    torch.testing.assert_close(got[0], linear_torch(x, w), atol=1e-4, rtol=1e-4)
    assert not PackedLinear(w, torch.zeros(320)).gemv_f32  # a bias goes to F.linear


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_gemv_f32.ENV_SWITCH, "0")
    cpu_gemv_f32._lib.cache_clear()
    try:
        assert cpu_gemv_f32._lib() is None
    finally:
        cpu_gemv_f32._lib.cache_clear()


def test_packed_float32_layers_serve_through_the_kernel_and_still_train():
    """A float32 drafter loaded for serving is packed (``pack_linears``) and may then be
    trained: products autograd must see go to ``F.linear`` with the live parameter."""
    from dataplane.kernels.cpu_linear import pack_linears

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 16, bias=False))
    packed = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 16, bias=False))
    packed.load_state_dict(plain.state_dict())
    assert pack_linears(packed) == (2 if cpu_gemv_f32.pays() else 0)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
    for model in (plain, packed):
        model.zero_grad()
        model(x).square().sum().backward()
    for a, b in zip(plain.parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    with torch.no_grad():  # an update in place is seen by the next served product
        for p in packed.parameters():
            p.mul_(2.0)
        for p in plain.parameters():
            p.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
