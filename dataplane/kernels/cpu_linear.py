"""y = x W^T for the serving forward, with the weight laid out once for the CPU's GEMM.

On CPU every decode or verify step multiplies a handful of rows by every weight matrix:
the step is bound by reading the weights. Eager ``F.linear`` in bfloat16 hands oneDNN a
plain row-major weight on every call, which it re-lays out in blocks before the product;
prepacking the weight once (``torch.ops.mkldnn._reorder_linear_weight``) removes that
work from the step. Measured on a 2-core Xeon with AMX-BF16 (all 121 fused matrices of
one SmolLM2-135M forward, 1/4/16 rows): eager bfloat16 19.3/20.8/21.1 ms, prepacked
12.4/12.4/13.4 ms. In float32 the packed path is slower than MKL's one-row GEMM, so it is
used for bfloat16 only. One to four rows go through our own streaming kernel
(``dataplane.kernels.cpu_gemv``) and, on CPUs with AMX-BF16, the rows of verify and
decode steps up to ``cpu_amx.MAX_ROWS`` through our AMX kernel (``dataplane.kernels.cpu_amx``),
each where it is measured to beat oneDNN here.

``linear_torch`` is the reference; ``PackedLinear`` must equal it up to the rounding of
the accumulation order (tested).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dataplane.kernels import cpu_amx, cpu_gemv


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


class PackedLinear:
    """One weight matrix ready for the serving forward.

    weight [N, K] (and bias [N]) on CPU in bfloat16: packed for oneDNN once; any other
    dtype or device: plain ``F.linear`` (MKL on CPU, cuBLAS on CUDA). ``weight`` keeps the
    plain tensor (views of it stay valid for the reference path).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.packed = None
        if (pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and mkldnn_packing_works(weight.dtype)):
            self.packed = mkldnn_packed(weight)
        # one to four rows: our streaming kernel where it is measured to pay (cpu_gemv)
        self.gemv = pack and bias is None and cpu_gemv.takes_weight(weight) and cpu_gemv.pays()
        # up to cpu_amx.MAX_ROWS rows: the AMX kernel where the CPU has it and it pays (cpu_amx)
        self.amx = (cpu_amx.pack(weight) if pack and bias is None and cpu_amx.takes_weight(weight)
                    and cpu_amx.pays() else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        if (self.packed is None and not self.gemv and self.amx is None) or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        if self.gemv and rows <= cpu_gemv.MAX_ROWS:
            y = cpu_gemv.gemv(x, self.weight)
        elif self.amx is not None and rows <= cpu_amx.MAX_ROWS:
            y = cpu_amx.gemm(x, self.amx)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.view(*lead, self.out_features)


def pack_linears(module: torch.nn.Module) -> int:
    """Serve every bfloat16 CPU ``nn.Linear`` of a frozen ``module`` through ``PackedLinear``.

    For inference only: the packed copy does not follow later changes of the weights. Layers
    in other precisions are left alone. Returns how many layers were packed.
    """
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
            lin = PackedLinear(m.weight.detach(), None if m.bias is None else m.bias.detach())
            if lin.packed is not None:
                m.forward = lin  # instance attribute: nn.Module.__call__ finds it first
                n += 1
    return n
