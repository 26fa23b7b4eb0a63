"""y = x W^T for the serving forward, with the weight laid out once for the CPU's GEMM.

On CPU every decode or verify step multiplies a handful of rows by every weight matrix:
the step is bound by reading the weights. Eager ``F.linear`` in bfloat16 hands oneDNN a
plain row-major weight on every call, which it re-lays out in blocks before the product;
prepacking the weight once (``torch.ops.mkldnn._reorder_linear_weight``) removes that
work from the step. Measured on a 2-core Xeon with AMX-BF16 (all 121 fused matrices of
one SmolLM2-135M forward, 1/4/16 rows): eager bfloat16 19.3/20.8/21.1 ms, prepacked
12.4/12.4/13.4 ms. In float32 the packed path is slower than MKL's one-row GEMM, so it is
used for bfloat16 only. Decode and verify steps go through kernels of our own, each where
it is measured to beat oneDNN here (``kernel_plan``): one to four rows through the
streaming GEMV (``dataplane.kernels.cpu_gemv``), and up to 256 rows on the AMX B-tile
layout, through the AMX kernel (``dataplane.kernels.cpu_amx``) on CPUs with AMX-BF16 or
else through AVX512-BF16 dot products (``dataplane.kernels.cpu_dpbf16``), which also take
one to four rows where they beat the GEMV.

``linear_torch`` is the reference; ``PackedLinear`` must equal it up to the rounding of
the accumulation order (tested).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from dataplane.kernels import cpu_amx, cpu_dpbf16, cpu_gemv, cpu_gemv_f32


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x [M, K] @ weight[N, K]^T + bias [N] -> [M, N]."""
    return F.linear(x, weight, bias)


def mkldnn_packed(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] laid out once for oneDNN's linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


@functools.cache
def mkldnn_packing_works(dtype: torch.dtype) -> bool:
    """True if oneDNN's prepacked linear runs here in ``dtype`` and agrees with the reference."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(48, 32, generator=g) * 0.1).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), linear_torch(x, w).float(), atol=2e-2, rtol=2e-2))
    except (RuntimeError, AttributeError):
        return False


@dataclass(frozen=True)
class KernelPlan:
    """Which of our kernels serve products here.

    bfloat16: ``gemv``: one to ``cpu_gemv.MAX_ROWS`` rows through the streaming GEMV.
    ``tiled``: the module (``cpu_amx`` or ``cpu_dpbf16``) whose ``gemm`` serves up to its
    ``MAX_ROWS`` rows on the B-tile layout (rows the GEMV takes go to the GEMV); None where
    neither pays. float32: ``gemv_f32``: one to ``cpu_gemv_f32.MAX_ROWS`` rows through the
    AVX2 kernel.
    """

    gemv: bool
    tiled: ModuleType | None
    gemv_f32: bool = False

    def describe(self) -> dict:
        """The plan as the benchmark's machine report shows it."""
        first = cpu_gemv.MAX_ROWS + 1 if self.gemv else 1
        return {"gemv_bf16_rows": f"1-{cpu_gemv.MAX_ROWS}" if self.gemv else None,
                "tiled_kernel": None if self.tiled is None else self.tiled.__name__.rsplit(".", 1)[-1],
                "tiled_rows": None if self.tiled is None else f"{first}-{self.tiled.MAX_ROWS}",
                "gemv_f32_rows": f"1-{cpu_gemv_f32.MAX_ROWS}" if self.gemv_f32 else None}


@functools.cache
def kernel_plan() -> KernelPlan:
    """Decided once per process from the kernels' kept verdicts: AMX where it pays, else the
    AVX512-BF16 kernel where it pays; the GEMV where it pays, unless the AVX512-BF16 kernel
    also beats it at one row. float32: the AVX2 kernel where it pays."""
    tiled = cpu_amx if cpu_amx.pays() else cpu_dpbf16 if cpu_dpbf16.pays() else None
    gemv = cpu_gemv.pays() and not (tiled is cpu_dpbf16 and cpu_dpbf16.serves_one_row())
    return KernelPlan(gemv=gemv, tiled=tiled, gemv_f32=cpu_gemv_f32.pays())


class PackedLinear:
    """One weight matrix ready for the serving forward.

    weight [N, K] (and bias [N]) on CPU in bfloat16: packed for oneDNN once; in float32:
    up to ``cpu_gemv_f32.MAX_ROWS`` rows through the AVX2 kernel where it pays; otherwise
    plain ``F.linear`` (MKL on CPU, cuBLAS on CUDA). ``weight`` keeps the plain tensor
    (views of it stay valid for the reference path).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.packed = None
        if (pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and mkldnn_packing_works(weight.dtype)):
            self.packed = mkldnn_packed(weight)
        ours = pack and bias is None and (cpu_gemv.takes_weight(weight) or cpu_amx.takes_weight(weight))
        plan = kernel_plan() if ours else KernelPlan(gemv=False, tiled=None)
        # up to tiled.MAX_ROWS rows: the AMX or AVX512-BF16 kernel on the B-tile layout, where it pays
        self.tiled = plan.tiled if cpu_amx.takes_weight(weight) else None
        self.tiles = None if self.tiled is None else cpu_amx.pack(weight)
        # one to four rows: our streaming kernel where it is measured to pay (cpu_gemv), also
        # for a weight the tiled kernel cannot take
        self.gemv = ours and cpu_gemv.takes_weight(weight) and (plan.gemv or (self.tiled is None and cpu_gemv.pays()))
        self.gemv_f32 = pack and bias is None and cpu_gemv_f32.takes_weight(weight) and kernel_plan().gemv_f32

    @property
    def ours(self) -> bool:
        """Some product is served other than by plain ``F.linear``."""
        return self.packed is not None or self.gemv or self.tiled is not None or self.gemv_f32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]. A product that autograd must see (x or the weight requires
        grad, grad enabled) goes to ``F.linear``: the kernels carry no gradients."""
        if (not self.ours or x.dtype != self.weight.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        if self.gemv_f32 and rows <= cpu_gemv_f32.MAX_ROWS:
            y = cpu_gemv_f32.gemv(x, self.weight)
        elif self.gemv and rows <= cpu_gemv.MAX_ROWS:
            y = cpu_gemv.gemv(x, self.weight)
        elif self.tiled is not None and rows <= self.tiled.MAX_ROWS:
            y = self.tiled.gemm(x, self.tiles)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.view(*lead, self.out_features)


def pack_linears(module: torch.nn.Module) -> int:
    """Serve the CPU ``nn.Linear`` layers of ``module`` through ``PackedLinear``: bfloat16
    ones laid out for oneDNN (for a frozen module only: the packed copy does not follow later
    changes of the weights), float32 ones through the AVX2 kernel where it pays (it reads the
    parameter itself, and a product autograd must see still goes to ``F.linear``, so a
    float32 drafter loaded for serving can be trained). Returns how many layers were packed.
    """
    n = 0
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or m.weight.device.type != "cpu":
            continue
        if m.weight.dtype == torch.float32:
            lin = PackedLinear(m.weight, m.bias)
            if lin.gemv_f32:
                m.forward = lin
                n += 1
        elif m.weight.dtype == torch.bfloat16:
            lin = PackedLinear(m.weight.detach(), None if m.bias is None else m.bias.detach())
            if lin.packed is not None:
                m.forward = lin  # instance attribute: nn.Module.__call__ finds it first
                n += 1
    return n
