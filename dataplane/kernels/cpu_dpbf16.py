"""y = x W^T for one to a few hundred rows in bfloat16 with AVX512-BF16 dot products
(``gemm_dpbf16.c``), for CPUs that have AVX512-BF16 but no AMX.

On such a CPU (AMD EPYC Zen 4) every bfloat16 product went through oneDNN's prepacked
GEMM or, for one to four rows, our streaming GEMV (``cpu_gemv``), whose dot products end
in a horizontal sum per output. Measured on a 2-core AMD EPYC with AVX512-BF16 and no
AMX, all 121 fused matrices of one SmolLM2-135M forward (weights cycled out of L2, two
threads, fastest of seven): one row 11.8 ms through oneDNN, 11.7 ms through the GEMV,
6.1-8.4 ms here; 16 rows 17.3-17.8 ms through oneDNN, 13.1-13.7 ms here; 64 rows 47-51 ms
against 42 ms; 256 rows 164 against 160 ms. The kernel reads the weights in the AMX
B-tile layout (``cpu_amx.pack``): one 64-byte line holds a pair of k for 16 columns, so a
broadcast pair of x and one ``vdpbf16ps`` add into 16 column sums with nothing left to
reduce, and eight rows of x share each line while it sits in L1.

Used only where the CPU has AVX512-BF16, the kernel builds, a check against
``cpu_gemv.gemv_torch`` passes, and a probe of 16 rows beats oneDNN here (``pays``); it
also takes one to four rows where a one-row probe beats the GEMV (``serves_one_row``).
Where AMX pays, the AMX kernel serves instead (``cpu_linear.kernel_plan``).
``ADAFLASH_CPU_DPBF16=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from dataplane.kernels import cpu_gemv
from dataplane.kernels.cpu_amx import pack, tiled_agrees, tiled_product
from dataplane.kernels.cpu_gemv import beats, bind_product, kept_verdict, load_kernel
from dataplane.kernels.cpu_info import cpu_flags

SOURCE = Path(__file__).with_name("gemm_dpbf16.c")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "ADAFLASH_CPU_DPBF16"
MAX_ROWS = 256  # rows of x the kernel serves; more rows (prompts) go to oneDNN


@functools.cache
def _lib():
    """The loaded kernel, or None where it cannot run here (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or "avx512_bf16" not in cpu_flags():
        return None
    lib = load_kernel(SOURCE, CFLAGS, "AVX512-BF16 GEMM kernel")
    return None if lib is None else bind_product(lib.adaflash_dpbf16_gemm)


def gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) @ W^T with W laid out by ``cpu_amx.pack`` -> [M, N] bf16."""
    return tiled_product(_lib(), x, packed, "gemm_dpbf16")


@functools.cache
def available() -> bool:
    """The kernel loads here and agrees with the reference (bf16 rounding of the output)."""
    return _lib() is not None and tiled_agrees(gemm, "AVX512-BF16 GEMM kernel")


@functools.cache
def pays() -> bool:
    """16 rows through the kernel beat oneDNN's prepacked product (``cpu_gemv.beats``), as kept for this machine."""
    return available() and kept_verdict(
        SOURCE, lambda: beats(gemm, pack, 16, 0.95, "AVX512-BF16 GEMM kernel"), "16 rows against oneDNN")


@functools.cache
def serves_one_row() -> bool:
    """One row through the kernel beats what would serve it otherwise: the GEMV where that
    pays here, else oneDNN (kept for this machine like ``pays``)."""
    if not pays():
        return False
    if cpu_gemv.pays():
        return kept_verdict(SOURCE, lambda: beats(gemm, pack, 1, 0.95, "AVX512-BF16 GEMM kernel",
                                                  (cpu_gemv.gemv, lambda w: w), "GEMV kernel"), "1 row against GEMV")
    return kept_verdict(SOURCE, lambda: beats(gemm, pack, 1, 0.95, "AVX512-BF16 GEMM kernel"), "1 row against oneDNN")
