"""y = x W^T for a few to a few dozen rows in bfloat16 on CPU with AMX tiles (``gemm_amx.c``).

A verify step multiplies every weight matrix by the 2-16 rows of the tokens it checks
(more at higher concurrency). One row goes through the streaming GEMV
(``dataplane.kernels.cpu_gemv``), but from five rows up oneDNN's prepacked product served
every matrix, and it costs far more than reading the weights: measured on a 2-core Xeon
with AMX-BF16, all 121 fused matrices of one SmolLM2-135M forward (weights cycled out of
L2, two threads), 16 rows took 20.6 ms through oneDNN and 13.6 ms here (1 row 11.7 ms).
AMX's tile product does 16 x 16 x 32 multiply-adds in one instruction, so a step of up to
16 rows stays bound by streaming the weights: this kernel reads each packed weight block
once and walks every 16-row chunk of x over it while the block sits in cache.

Weights are laid out once (``pack``): [N/16, K/32, 16 k-pairs, 16 columns, 2] bf16, the
B-tile layout of ``tdpbf16ps``. Used only where the CPU has AMX-BF16, the kernel builds,
the OS grants the tile state, a check against ``cpu_gemv.gemv_torch`` passes, and a probe
of 16 rows beats oneDNN here (``pays``). ``ADAFLASH_CPU_AMX=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from dataplane.kernels.cpu_gemv import beats, bind_product, gemv_torch, kept_verdict, load_kernel
from dataplane.kernels.cpu_info import cpu_flags

log = logging.getLogger("adaflash.kernels")

SOURCE = Path(__file__).with_name("gemm_amx.c")
CFLAGS = ["-O3", "-mavx512f", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "ADAFLASH_CPU_AMX"
MAX_ROWS = 256  # rows of x the kernel serves; more rows (prompts) go to oneDNN


def takes_weight(weight: torch.Tensor) -> bool:
    """Weights the kernel takes: [N, K] contiguous bf16 on CPU with N % 16 == 0 and K % 32 == 0."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [N/16, K/32, 16, 16, 2]: element [nb, kb, r, c, j] = weight[16 nb + c, 32 kb + 2 r + j]."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


@functools.cache
def _lib():
    """The loaded kernel with the tile state granted, or None where it cannot run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not {"amx_bf16", "amx_tile"} <= set(cpu_flags()):
        return None
    lib = load_kernel(SOURCE, CFLAGS, "AMX kernel")
    if lib is None:
        return None
    if lib.adaflash_amx_init() != 0:
        log.info("the OS refused the AMX tile state; oneDNN serves every product")
        return None
    return bind_product(lib.adaflash_amx_gemm_bf16)


def tiled_product(kernel, x: torch.Tensor, packed: torch.Tensor, label: str) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) @ W^T with W laid out by ``pack`` -> [M, N] bf16,
    through ``kernel`` (a bound product on this layout: this module's or ``cpu_dpbf16``'s)."""
    m, k = x.shape
    n = packed.shape[0] * 16
    if packed.shape[1] * 32 != k or x.dtype != torch.bfloat16 or x.stride(1) != 1 or m < 1:
        raise ValueError(f"{label} refused x {tuple(x.shape)} packed {tuple(packed.shape)}")
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if kernel(x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k, y.data_ptr(), n, torch.get_num_threads()):
        raise ValueError(f"{label} refused x {tuple(x.shape)} packed {tuple(packed.shape)}")
    return y


def tiled_agrees(gemm, label: str) -> bool:
    """``gemm(x, pack(w))`` agrees with ``gemv_torch`` (bf16 rounding of the output) over row
    counts and a weight of one group of four blocks plus three single ones."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(112, 96, generator=g) * 0.1).to(torch.bfloat16)
    p = pack(w)
    for m in (1, 5, 9, 16, 17, 40):
        x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
        if not torch.allclose(gemm(x, p).float(), gemv_torch(x, w).float(), atol=1e-2, rtol=1e-2):
            log.warning("%s disagrees with the reference; not used", label)
            return False
    return True


def gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) @ W^T with W packed by ``pack`` -> [M, N] bf16."""
    return tiled_product(_lib(), x, packed, "gemm_amx")


@functools.cache
def available() -> bool:
    """The kernel loads here and agrees with the reference (bf16 rounding of the output)."""
    return _lib() is not None and tiled_agrees(gemm, "AMX kernel")


@functools.cache
def pays() -> bool:
    """16 rows through the kernel beat oneDNN's prepacked product (``cpu_gemv.beats``).

    Measured once per machine and kept (``cpu_gemv.kept_verdict``)."""
    return available() and kept_verdict(SOURCE, lambda: beats(gemm, pack, 16, 0.95, "AMX kernel"))
