"""The C RMS norm and rotary embedding (dataplane/kernels/elementwise_bf16.c) against their
torch references: bit for bit in bfloat16 on any AVX2 CPU, the references themselves for
every other dtype or layout."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_elementwise as ew
from dataplane.precision import cpu_flags

HAS_AVX2 = "avx2" in cpu_flags()


def test_available_wherever_the_cpu_has_avx2():
    assert ew.available() == HAS_AVX2


@pytest.mark.parametrize("rows", [1, 3, 16, 65, 300])  # 65 and 300 run on several threads
@pytest.mark.parametrize("hidden", [576, 100, 7])
def test_rms_norm_equals_the_reference(rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 4).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    got, ref = ew.rms_norm(x, w, 1e-5), ew.rms_norm_torch(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    # one rounding of the same float32 value; the sum's order may differ by an ulp of float32
    torch.testing.assert_close(got.float(), ref.float(), atol=0, rtol=8e-3)
    assert (got != ref).float().mean() < 1e-3


def test_rms_norm_of_strided_rows_and_other_dtypes():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 1152, generator=g).to(torch.bfloat16)
    x = base[:, :576]  # a row stride of 1152
    w = torch.randn(576, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(ew.rms_norm(x, w, 1e-6).float(), ew.rms_norm_torch(x, w, 1e-6).float(),
                               atol=0, rtol=8e-3)
    xf, wf = x.float(), w.float()  # float32 takes the reference itself
    assert torch.equal(ew.rms_norm(xf, wf, 1e-6), ew.rms_norm_torch(xf, wf, 1e-6))


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_rotary_equals_the_reference_bit_for_bit(tokens):
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, 15, 64, generator=g) * 3).to(torch.bfloat16)
    qk = qkv[:, :12]  # q and k heads of a fused qkv: a token stride of 15 heads
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(32) / 32))
    ang = torch.cat([pos, pos], dim=-1)
    cos, sin = ang.cos().unsqueeze(1).to(torch.bfloat16), ang.sin().unsqueeze(1).to(torch.bfloat16)
    got = ew.rotary(qk, cos, sin)
    assert got.is_contiguous() and got.shape == (tokens, 12, 64)
    assert torch.equal(got, ew.rotary_torch(qk, cos, sin))


def test_nan_stays_nan():
    x = torch.ones(2, 64).to(torch.bfloat16)
    x[0, 3] = float("nan")
    w = torch.ones(64).to(torch.bfloat16)
    got = ew.rms_norm(x, w, 1e-5)
    assert torch.isnan(got[0]).all() and not torch.isnan(got[1]).any()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(ew.ENV_SWITCH, "0")
    ew._lib.cache_clear()
    try:
        assert ew._lib() is None
    finally:
        ew._lib.cache_clear()
