"""Every decoder layer of a bfloat16 forward in one C call (``forward_bf16.c``).

Where a node serves bfloat16 on CPU, the products, norms, rotation and attention already
ran in kernels of our own, but each layer still made about ten calls from Python (four
products, two norms, the rotation, attention, the gated SiLU and two residual adds), and
each found the interpreter and PyTorch's dispatcher evicted from the caches by the
weights streaming past. Here the layers run back to back in C. The C loop calls the very
kernels the Python path calls, through their addresses in the libraries this process
loaded (``kernel_pointers``), so products, norms, rotation and attention compute every
row as there; only the SiLU is our own (float32 to the last bit, then rounded to
bfloat16 as PyTorch rounds it). The output norm and head stay in Python.
Measured on a 2-core AMD EPYC (family 25 model 17, Zen 4; avx512_bf16, no AMX; every
product through the dpbf16 kernel) against the Python layers in one process, 128 cached
tokens, fastest (median) of seven interleaved runs: one token at C=1 9.0 (12.1) against
12.3 (16.5) ms, sixteen 19.4 (21.2) against 21.1 (23.1); one token each at C=16 23.4
against 24.2, at C=32 41.3 against 45.3; sixteen each at C=16 218 against 222; a prompt
of 100 tokens 70 against 77 ms, of 250 tokens 196 against 215 ms.

Taken where the target serves bfloat16 on CPU, a tiled kernel (AMX or AVX512-BF16) serves
the products here (``cpu_linear.kernel_plan``), the elementwise and attention libraries
load, and the library agrees with ``cpu_forward.layers_torch`` (``available``): every
stream of at most ``MAX_TOKENS`` rows. ``ADAFLASH_CPU_FORWARD=0`` turns it off, as it
does the float32 forward.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dataplane.kernels import cpu_attention, cpu_elementwise, cpu_gemv, cpu_gemv_f32
from dataplane.kernels.cpu_forward import ENV_SWITCH, LayerStack, LayerWeights, layers_torch
from dataplane.kernels.cpu_linear import PackedLinear, kernel_plan

SOURCE = Path(__file__).with_name("forward_bf16.c")
MAX_TOKENS = 512  # rows of a stream taken; longer prompts go through the Python layers

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib():
    """The loaded library, or None where it cannot be used here."""
    lib = cpu_gemv_f32.load_avx2(SOURCE, ENV_SWITCH, "bfloat16 forward kernel")
    if lib is None:
        return None
    fn = lib.adaflash_forward_bf16
    fn.argtypes = [_P, _I, _I, _I, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I,
                   _P, _P, _I, _I, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def kernel_pointers() -> tuple[ctypes.Array, int, int] | None:
    """(the five kernels' addresses: GEMV, tiled product, RMS norm, rotation, batched
    attention; rows the GEMV takes; rows a tiled call takes), as the Python path would
    call them here, or None where one of them does not serve here."""
    plan = kernel_plan()
    if plan.tiled is None or not cpu_elementwise.available() or not cpu_attention.available():
        return None
    gemv = plan.gemv and cpu_gemv.available()
    el, att = cpu_elementwise._lib(), cpu_attention._lib()
    fns = (ctypes.c_void_p * 5)(_address(cpu_gemv._lib()) if gemv else None, _address(plan.tiled._lib()),
                                _address(el.adaflash_rms_norm), _address(el.adaflash_rotary),
                                _address(att.adaflash_attend_cached_batch))
    return fns, cpu_gemv.MAX_ROWS if gemv else 0, plan.tiled.MAX_ROWS


class LayerStackBF16(LayerStack):
    """The bfloat16 layers of one model and their products laid out for the tiled kernel,
    addresses laid out once: per layer the six row-major tensors, then the four tiled ones."""

    DTYPE = torch.bfloat16
    MAX_TOKENS = MAX_TOKENS

    def __init__(self, layers: list[LayerWeights], tiles: list[tuple[torch.Tensor, ...]], heads: int, kv_heads: int,
                 eps: float):
        self.tiles = tiles  # keeps the tiled weights alive while their addresses are in use
        super().__init__(layers, heads, kv_heads, eps)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for w, tl in zip(self.layers, self.tiles, strict=True) for t in (*w.tensors(), *tl)]

    @classmethod
    def fits(cls, layers: list[LayerWeights], products: list[tuple[PackedLinear, ...]]) -> bool:
        """Contiguous bfloat16 CPU weights, every product laid out for the tiled kernel."""
        return super().fits(layers) and all(p.tiles is not None for ps in products for p in ps)

    @classmethod
    def of_products(cls, layers: list[LayerWeights], products: list[tuple[PackedLinear, ...]], heads: int,
                    kv_heads: int, eps: float) -> LayerStackBF16:
        """The stack of ``layers`` with the tiled weights of their ``products`` (check ``fits`` first)."""
        return cls(layers, [tuple(p.tiles for p in ps) for ps in products], heads, kv_heads, eps)

    def _call(self, *args) -> int:
        fns, gemv_rows, tiled_rows = kernel_pointers()
        return _lib()(*args, fns, gemv_rows, tiled_rows, torch.get_num_threads())


def stack_of(layers: list[LayerWeights], products: list[tuple[PackedLinear, ...]], heads: int, kv_heads: int,
             eps: float) -> LayerStackBF16 | None:
    """The layers as a ``LayerStackBF16`` where the C forward serves them here (bfloat16
    weights laid out for the tiled kernel, the kernels it calls serving here, the library
    correct), else None. ``products``: per layer its qkv, o, gate_up and down ``PackedLinear``."""
    if not LayerStackBF16.fits(layers, products) or not available():
        return None
    return LayerStackBF16.of_products(layers, products, heads, kv_heads, eps)


@functools.cache
def available() -> bool:
    """The library loads here, the kernels it calls serve here, and it agrees with
    ``layers_torch`` in bfloat16 (hidden states to two bfloat16 steps, caches to 2e-2) and
    gives a request's rows what they are alone."""
    if _lib() is None or kernel_pointers() is None:
        return False
    g = torch.Generator().manual_seed(0)
    H, heads, kvh, d, inter, L = 64, 4, 2, 16, 96, 2

    def r(*shape, s=0.2):
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    layers = [LayerWeights(1 + r(H), r((heads + 2 * kvh) * d, H), r(H, heads * d), 1 + r(H), r(2 * inter, H),
                           r(H, inter)) for _ in range(L)]
    products = [tuple(PackedLinear(m) for m in (w.qkv, w.o, w.gate_up, w.down)) for w in layers]
    if not LayerStackBF16.fits(layers, products):
        return False
    stack = LayerStackBF16.of_products(layers, products, heads, kvh, 1e-5)
    bounds = [(0, 1, 5), (1, 4, 2), (4, 11, 0)]
    T = 11
    x, pos = r(T, H, s=1.0), torch.tensor([5, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6])
    ang = pos.unsqueeze(1) * torch.linspace(0.1, 1.0, d // 2).repeat(2).unsqueeze(0)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    base = [torch.randn(L, 2, kvh, 12, d, generator=g) for _ in bounds]
    c_ref, c_ours = [c.clone() for c in base], [c.clone() for c in base]
    want_x, want_h = layers_torch(x, layers, heads, kvh, 1e-5, cos, sin, c_ref, bounds, (0, 1))
    got_x, got_h = stack.run(x, cos, sin, c_ours, bounds, (0, 1))

    def close(a, b, tol=3e-2):
        return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)

    ok = (close(got_x, want_x) and close(got_h, want_h)
          and all(close(a, b, 2e-2) for a, b in zip(c_ours, c_ref, strict=True)))
    # the second request alone, from the same cache: its rows bit for bit
    alone = [base[1].clone()]
    x1, _ = stack.run(x[1:4], cos[1:4], sin[1:4], alone, [(0, 3, 2)])
    return bool(ok and torch.equal(x1, got_x[1:4]))
