"""The RMS norm and rotary embedding in bfloat16, one call each (``elementwise_bf16.c``).

With the products in kernels of our own, what was left of a bfloat16 decode step on CPU
was largely PyTorch's per-operator cost on tiny tensors: ``F.rms_norm`` on bfloat16 runs
as several operators (upcast, pow, mean, add, rsqrt, multiplies, downcast), 61 times a
forward, and the rotary embedding as five, 30 times. Measured on the 2-core AMD EPYC
(Zen 4, avx512_bf16), fastest of five: the norm of 1/16/256 rows of 576 took 14.0/18.1/
63.3 us through PyTorch and 7.5/10.8/35.7 us here; the rotation of 12 heads of 64 took
13.1/21.5/143.3 us and 7.5/16.3/87.6 us. Each rounds to bfloat16 where the PyTorch
expression rounds. (A C SiLU-gated product was slower than PyTorch's vectorised one and
is not here.)

Used for bfloat16 CPU tensors where the library builds and agrees with the torch
references below (``available``); everything else takes the references.
``ADAFLASH_CPU_ELEMENTWISE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from dataplane.kernels.cpu_gemv import load_kernel
from dataplane.kernels.cpu_info import cpu_flags

log = logging.getLogger("adaflash.kernels")

SOURCE = Path(__file__).with_name("elementwise_bf16.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]  # every CPU here has AVX2 (checked)
ENV_SWITCH = "ADAFLASH_CPU_ELEMENTWISE"


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: x [T, H] -> RMS-normed, times weight [H]."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: x [T, heads, d]; cos, sin [T, 1, d] in x's dtype -> rotated x [T, heads, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _lib():
    """The loaded library, or None where it cannot be used here (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or "avx2" not in cpu_flags():
        return None
    lib = load_kernel(SOURCE, CFLAGS, "elementwise kernels")
    if lib is None:
        return None
    lib.adaflash_rms_norm.argtypes = [_P, _I, _P, _F, _I, _I, _P, _I, ctypes.c_int]
    lib.adaflash_rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, ctypes.c_int]
    for fn in (lib.adaflash_rms_norm, lib.adaflash_rotary):
        fn.restype = None
    return lib


def _ours(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts) and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """x [T, H] bf16 -> RMS-normed times weight [H], as ``rms_norm_torch``."""
    if (eps is None or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous()
            or not _ours(x, weight)):
        return rms_norm_torch(x, weight, eps)
    return _rms_norm(x, weight, eps)


def _rms_norm(x, weight, eps):
    y = torch.empty(x.shape, dtype=x.dtype)
    _lib().adaflash_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, x.shape[0], x.shape[1],
                             y.data_ptr(), y.stride(0), torch.get_num_threads())
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] bf16 (heads contiguous); cos, sin [T, 1, d] -> rotated [T, heads, d], as ``rotary_torch``."""
    T, heads, d = x.shape
    if (x.stride(2) != 1 or x.stride(1) != d or d % 2 or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape != (T, 1, d) or sin.shape != (T, 1, d) or not _ours(x, cos, sin)):
        return rotary_torch(x, cos, sin)
    return _rotary(x, cos, sin)


def _rotary(x, cos, sin):
    T, heads, d = x.shape
    out = torch.empty(T, heads, d, dtype=x.dtype)
    _lib().adaflash_rotary(x.data_ptr(), x.stride(0), T, heads, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
    return out


@functools.cache
def available() -> bool:
    """The library loads here and agrees with the references (the rotation bit for bit, the
    norm to one bfloat16 step)."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16)
    q = torch.randn(3, 6, 16, generator=g).to(torch.bfloat16)[:, :4]  # [T, heads, d] with a token stride
    cs = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    sn = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    ok = (torch.allclose(_rms_norm(x, w, 1e-5).float(), rms_norm_torch(x, w, 1e-5).float(), atol=1e-2, rtol=1e-2)
          and torch.equal(_rotary(q, cs, sn), rotary_torch(q, cs, sn)))
    if not ok:
        log.warning("elementwise kernels disagree with their references; not used")
    return ok
