"""Every decoder layer of a float32 forward (decode, verify or prompt) in one C call (``forward_f32.c``).

Where a node serves float32 (a CPU without AVX512-BF16 or AMX), the products already ran
in our AVX2 kernel and attention in one call a layer, yet a decode step took about twice
the products' time: per layer, two RMS norms, the rotation, the gated activation, two
residual adds and four product calls each crossed from Python, and each found the
interpreter and PyTorch's dispatcher evicted from the caches by the weights streaming
past (an RMS norm of one row took 65 us inside the forward against 18 us on its own).
Measured on a 2-core AMD EPYC (Zen 3, AVX2 and FMA only), the 30 layers of SmolLM2-135M
at one token after 128: products 30.8 ms and the rest 11-13 ms of a 43 ms forward through
the fused Python layers. Here the layers run back to back in C; the output norm and head
stay in Python.

Taken where the target serves float32 on CPU, the float32 GEMV kernel pays
(``cpu_gemv_f32.pays``) and the library builds and agrees with ``layers_torch`` (the
reference, ``available``): every stream of at most ``MAX_TOKENS`` rows, decodes, verifies
and prompts.
Measured in one process against the Python layers, fastest of four to twelve interleaved
runs, 128 cached tokens each: one token at C=1 27.2 against 41.6 ms, sixteen 58.5 against
77.4; one token each at C=16 62.7 against 82.5, at C=32 122.6 against 123.0; sixteen each
at C=16 (256 rows) 745-761 against 901-968, at C=32 1,703 against 1,974; a prompt of 100
tokens 263 against 295 ms, of 250 tokens 659 against 919 ms.
``ADAFLASH_CPU_FORWARD=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dataplane.kernels import cpu_attention, cpu_gemv_f32
from dataplane.kernels.cpu_attention import BatchArgs, attend_batch_torch
from dataplane.kernels.cpu_elementwise import rms_norm_torch, rotary_torch

SOURCE = Path(__file__).with_name("forward_f32.c")
ALSO = (cpu_gemv_f32.SOURCE, cpu_attention.SOURCE)  # linked in: the products and the attention
ENV_SWITCH = "ADAFLASH_CPU_FORWARD"

# Rows of a stream taken, as far as measured faster: beyond, the products are a GEMM that MKL
# does better than 128-row passes of the GEMV kernel (the learner labels streams of 4,096).
MAX_TOKENS = 512

_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass
class LayerWeights:
    """One decoder layer's float32 weights: ln1, ln2 [H]; qkv [(heads + 2 kvh) d, H];
    o [H, heads d]; gate_up [2 inter, H]; down [H, inter]."""

    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ln1, self.qkv, self.o, self.ln2, self.gate_up, self.down


def layers_torch(x: torch.Tensor, layers: list[LayerWeights], heads: int, kv_heads: int, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor],
                 bounds: list[tuple[int, int, int]], slot_layers: tuple[int, ...] = ()) -> tuple:
    """Reference. x [T, H]; cos, sin [T, d]; caches: per request its ``SeqKV.data``
    [L, 2, kv_heads, cap, d] float32, updated; bounds as the model's forward. Returns
    (x after the last layer [T, H], hidden [T, len(slot_layers), H] after the layers named)."""
    T, H = x.shape
    d = cos.shape[1]
    hidden = x.new_empty(T, len(slot_layers), H)
    cs, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    for i, w in enumerate(layers):
        h = rms_norm_torch(x, w.ln1, eps)
        qkv = F.linear(h, w.qkv).view(T, heads + 2 * kv_heads, d)
        qk = rotary_torch(qkv[:, : heads + kv_heads], cs, sn)
        att = attend_batch_torch(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:],
                                 [c[i] for c in caches], bounds)
        x = x + F.linear(att, w.o)
        gu = F.linear(rms_norm_torch(x, w.ln2, eps), w.gate_up)
        inter = gu.shape[1] // 2
        x = x + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w.down)
        for s, layer in enumerate(slot_layers):
            if layer == i:
                hidden[:, s] = x
    return x, hidden


@functools.cache
def _lib():
    """The loaded library, or None where it cannot be used here."""
    lib = cpu_gemv_f32.load_avx2(SOURCE, ENV_SWITCH, "float32 forward kernel", also=ALSO)
    if lib is None:
        return None
    fn = lib.adaflash_forward_f32
    fn.argtypes = [_P, _I, _I, _I, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I,
                   _P, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class LayerStack:
    """The float32 layers of one model, their weight addresses laid out once for the C forward."""

    DTYPE = torch.float32  # of the rows and weights
    MAX_TOKENS = MAX_TOKENS

    def __init__(self, layers: list[LayerWeights], heads: int, kv_heads: int, eps: float):
        self.layers = layers  # keeps the weights alive while their addresses are in use
        self.heads, self.kv_heads, self.eps = heads, kv_heads, float(eps)
        self.H = layers[0].ln1.shape[0]
        self.head_dim = layers[0].qkv.shape[0] // (heads + 2 * kv_heads)
        self.inter = layers[0].gate_up.shape[0] // 2
        ts = self.weight_tensors()
        self.ptrs = (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))

    def weight_tensors(self) -> list[torch.Tensor]:
        """What the C call's weight pointers point at, layer after layer."""
        return [t for w in self.layers for t in w.tensors()]

    @classmethod
    def fits(cls, layers: list[LayerWeights]) -> bool:
        """Contiguous CPU weights of ``DTYPE``, of the shapes the kernel takes."""
        ts = [t for w in layers for t in w.tensors()]
        return bool(ts) and all(t.dtype == cls.DTYPE and t.device.type == "cpu" and t.is_contiguous() for t in ts)

    def takes(self, x: torch.Tensor, bounds: list[tuple[int, int, int]], caches: list[torch.Tensor]) -> bool:
        """This stream runs here: at most ``MAX_TOKENS`` rows of ``DTYPE``, each request at least
        one new token, every cache a contiguous float32 ``SeqKV.data``."""
        return (x.dtype == self.DTYPE and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= self.MAX_TOKENS
                and bool(bounds) and all(e > s for s, e, _ in bounds)
                and all(c.dtype == torch.float32 and c.dim() == 5 and c.is_contiguous() for c in caches))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor],
            bounds: list[tuple[int, int, int]], slot_layers: tuple[int, ...] = (),
            hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``layers_torch`` (check ``takes`` first). x [T, H] is not modified; cos, sin [T, d]
        and ``hidden`` [T, len(slot_layers), H], which may be given to be filled, in ``DTYPE``."""
        T = x.shape[0]
        x = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        if hidden is None:
            hidden = x.new_empty(T, len(slot_layers), self.H)
        args = BatchArgs(caches, bounds)
        slots = (ctypes.c_int64 * max(len(slot_layers), 1))(*slot_layers)
        rc = self._call(x.data_ptr(), T, self.H, len(self.layers), self.ptrs, self.heads, self.kv_heads,
                        self.head_dim, self.inter, self.eps, cos.data_ptr(), sin.data_ptr(), args.B, args.row0, args.n,
                        args.caches, args.layer_stride, args.cap, args.start, hidden.data_ptr(), len(slot_layers),
                        slots)
        if rc != 0:
            raise RuntimeError(f"{self.DTYPE} forward kernel refused its arguments ({rc})")
        return x, hidden

    def _call(self, *args) -> int:
        """The C forward with ``run``'s arguments; its return code."""
        return _lib()(*args, torch.get_num_threads())


def stack_of(layers: list[LayerWeights], heads: int, kv_heads: int, eps: float) -> LayerStack | None:
    """The layers as a ``LayerStack`` where the C forward serves them here (float32 weights
    it takes, the GEMV kernel measured to pay, the library correct), else None."""
    if not LayerStack.fits(layers) or not cpu_gemv_f32.pays() or not available():
        return None
    return LayerStack(layers, heads, kv_heads, eps)


@functools.cache
def available() -> bool:
    """The library loads here, agrees with ``layers_torch`` (hidden states and caches to
    1e-4) and gives a request's rows what they are alone."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    H, heads, kvh, d, inter, L = 32, 4, 2, 8, 48, 2

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    layers = [LayerWeights(1 + r(H), r((heads + 2 * kvh) * d, H), r(H, heads * d), 1 + r(H), r(2 * inter, H),
                           r(H, inter)) for _ in range(L)]
    stack = LayerStack(layers, heads, kvh, 1e-5)
    bounds = [(0, 1, 5), (1, 4, 2), (4, 7, 0)]
    T = 7
    x, pos = r(T, H, s=1.0), torch.tensor([5, 2, 3, 4, 0, 1, 2])
    ang = pos.unsqueeze(1) * torch.linspace(0.1, 1.0, d // 2).repeat(2).unsqueeze(0)
    cos, sin = ang.cos(), ang.sin()
    base = [r(L, 2, kvh, 12, d, s=1.0) for _ in bounds]
    c_ref, c_ours = [c.clone() for c in base], [c.clone() for c in base]
    want_x, want_h = layers_torch(x, layers, heads, kvh, 1e-5, cos, sin, c_ref, bounds, (0, 1))
    got_x, got_h = stack.run(x, cos, sin, c_ours, bounds, (0, 1))
    ok = (torch.allclose(got_x, want_x, atol=1e-4, rtol=1e-4) and torch.allclose(got_h, want_h, atol=1e-4, rtol=1e-4)
          and all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(c_ours, c_ref, strict=True)))
    # the second request alone, from the same cache: its rows bit for bit
    alone = [base[1].clone()]
    x1, _ = stack.run(x[1:4], cos[1:4], sin[1:4], alone, [(0, 3, 2)])
    return bool(ok and torch.equal(x1, got_x[1:4]))
