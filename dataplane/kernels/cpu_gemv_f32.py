"""y = x W^T for one to 128 rows in float32 on CPU with AVX2 and FMA: a kernel of our own
(``gemv_f32.c``).

Where a node serves float32 (a CPU without AVX512-BF16 or AMX), every decode and verify
product went through MKL's ``F.linear``, whose few-row path is far from the bound of
reading the weights once. Measured on a 2-core AMD EPYC with AVX2 only (read bandwidth
31 GB/s, so the 540 MB of float32 weights stream in 17 ms), all 121 fused matrices and
the output head of one SmolLM2-135M forward, two threads, fastest of five: MKL 36-39 ms
for one row, 69-76 ms for two, 71-88 ms for four, 80-95 ms for sixteen, 160-194 ms for
64, 258 ms for 128; this kernel 18.5-21 ms, 20-23 ms, 22-26 ms, 44-51 ms, 117-122 ms and
239 ms. From about 200 rows on (longer prompts) MKL is faster. Every output is one
float32 accumulator over k in order, reduced by a fixed tree, so a row's result does not
depend on the rows beside it: a verify step's products equal a decode step's bit for bit.

Used only where the CPU has AVX2 and FMA, the kernel builds, a check against
``gemv_torch`` passes, and a probe of one row beats MKL here (``pays``, kept per machine
as ``cpu_gemv.kept_verdict`` keeps it). ``ADAFLASH_CPU_GEMV_F32=0`` turns it off.
``gemv_torch`` is the reference.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from dataplane.kernels.cpu_gemv import beats, bind_product, call_product, kept_verdict, load_kernel
from dataplane.kernels.cpu_info import cpu_flags

SOURCE = Path(__file__).with_name("gemv_f32.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "ADAFLASH_CPU_GEMV_F32"
MAX_ROWS = 128  # rows of x the kernel serves; more rows (longer prompts) go to MKL, faster there
K_MULTIPLE = 8


def gemv_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference: x [M, K] f32 @ weight [N, K]^T -> [M, N] f32."""
    return F.linear(x, weight)


def load_avx2(source: Path, switch: str, label: str, also: tuple[Path, ...] = ()):
    """An AVX2 and FMA library (``cpu_gemv.load_kernel``), or None where the CPU lacks them or
    the environment variable ``switch`` is 0."""
    flags = cpu_flags()
    if os.environ.get(switch, "1") == "0" or "avx2" not in flags or "fma" not in flags:
        return None
    return load_kernel(source, CFLAGS, label, also)


@functools.cache
def _lib():
    """The loaded kernel, or None where it cannot be used here."""
    lib = load_avx2(SOURCE, ENV_SWITCH, "float32 GEMV kernel")
    return None if lib is None else bind_product(lib.adaflash_gemv_f32)


def takes_weight(weight: torch.Tensor) -> bool:
    """Weights the kernel takes: [N, K] contiguous float32 on CPU with K % 8 == 0."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % K_MULTIPLE == 0)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M <= MAX_ROWS, K] float32 with unit column stride, and a weight it takes of the same K."""
    return (takes_weight(weight) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and x.shape[1] == weight.shape[1] and x.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] float32 with the kernel (callers check
    ``available`` and ``supported``)."""
    return call_product(_lib(), x, weight, "gemv_f32")


@functools.cache
def available() -> bool:
    """The kernel loads here, agrees with the reference and gives each row what it gives
    that row alone."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 96, generator=g) * 0.1
    for m in (1, 2, 3, 5, 9):
        x = torch.randn(m, 96, generator=g)
        y = gemv(x, w)
        if not torch.allclose(y, gemv_torch(x, w), atol=1e-4, rtol=1e-4) or not torch.equal(y[-1:], gemv(x[-1:], w)):
            return False
    return True


@functools.cache
def pays() -> bool:
    """One row through the kernel beats MKL's ``F.linear`` (``cpu_gemv.beats``), as kept for this machine."""
    return available() and kept_verdict(
        SOURCE, lambda: beats(gemv, lambda w: w, 1, 0.9, "float32 GEMV kernel", baseline=(F.linear, lambda w: w),
                              baseline_label="MKL", dtype=torch.float32), "1 row against MKL")
