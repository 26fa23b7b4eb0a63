"""A lone request's few-query attention over its float32 cache, one call a layer (``attention_f32.c``).

At concurrency 1 a decode step brings one token and a verify step a few; each layer then
stores the new keys and values and attends over the cache. Through PyTorch that is about
ten operators on tiny tensors per layer, mostly dispatch and OpenMP overhead: measured on
the 2-core AMD EPYC (Zen 4, avx512_bf16), 62 us a layer for one query and 124 us for
sixteen over 128 cached positions, against 28 and 78 us for the products and softmax
alone. Here the store, the scores, the softmax and the weighted values are one call in
float32; the queries, new keys and values come in the served precision (bfloat16 or
float32) and the output leaves in it.

Used by the fused serving forward (``dataplane.packed_attention.StreamPlan`` with
``fast``) where the library builds and agrees with the torch reference below
(``available``); the reference path of the model keeps PyTorch's attention.
``ADAFLASH_CPU_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from dataplane.kernels.cpu_gemv import load_kernel
from dataplane.kernels.cpu_info import cpu_flags

log = logging.getLogger("adaflash.kernels")

SOURCE = Path(__file__).with_name("attention_f32.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]  # every CPU here has AVX2 (checked)
ENV_SWITCH = "ADAFLASH_CPU_ATTENTION"
MAX_QUERIES = 64  # new tokens of one request the kernel takes (a decode or a verify)
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per kv head

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def attend_cached_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, start: int,
                        causal: bool = True) -> torch.Tensor:
    """Reference. q [n, heads, d]; k, v [n, kv_heads, d]; cache [2, kv_heads, cap, d] float32
    holding ``start`` positions of one layer. Stores k, v at start .. start+n-1 and returns
    [n, heads * d] in q's dtype: query i sees positions up to start + i (causal) or all
    start + n; query head h reads kv head h // (heads / kv_heads)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    g = heads // kvh
    cache[:, :, start : start + n] = torch.stack((k, v)).transpose(1, 2).to(cache.dtype)
    keys, vals = cache[0, :, : start + n], cache[1, :, : start + n]  # [kvh, L, d]
    qh = q.to(cache.dtype).reshape(n, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, n * g, d)
    scores = torch.bmm(qh, keys.transpose(1, 2)) * (d**-0.5)  # [kvh, n*g, L]
    if causal and n > 1:
        pos = torch.arange(start, start + n).repeat_interleave(g).view(1, n * g, 1)
        scores = scores.masked_fill(torch.arange(start + n).view(1, 1, -1) > pos, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), vals)  # [kvh, n*g, d]
    return out.reshape(kvh, n, g, d).permute(1, 0, 2, 3).reshape(n, heads * d).to(q.dtype)


@functools.cache
def _lib():
    """The loaded library, or None where it cannot be used here (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or "avx2" not in cpu_flags():
        return None
    lib = load_kernel(SOURCE, CFLAGS, "attention kernel")
    if lib is None:
        return None
    lib.adaflash_attend_cached.argtypes = [_P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _P, _I, _I, _C, _P, _I, _C, _F,
                                               _C]
    lib.adaflash_attend_cached.restype = _C
    lib.adaflash_attend_cached_batch.argtypes = [_P, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I,
                                                 _P, _I, _C, _F, _C]
    lib.adaflash_attend_cached_batch.restype = _C
    return lib


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """The kernel serves these shapes and layouts here (else the caller takes the reference)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    return (q.device.type == "cpu" and cache.dtype == torch.float32 and cache.is_contiguous()
            and q.dtype in (torch.bfloat16, torch.float32) and k.dtype == q.dtype
            and 0 < n <= MAX_QUERIES and d <= MAX_HEAD_DIM and d % 8 == 0 and heads % kvh == 0 and heads // kvh <= MAX_GROUP
            and v.dtype == q.dtype and all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v))
            and available())


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, start: int,
                  causal: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """As ``attend_cached_torch`` (shapes there), in one call; ``out`` [n, heads * d] in q's
    dtype with unit column stride may be given. Check ``takes`` first."""
    n, heads, d = q.shape
    if out is None:
        out = torch.empty(n, heads * d, dtype=q.dtype)
    rc = _lib().adaflash_attend_cached(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), n, heads, k.shape[1], d,
        cache.data_ptr(), cache.shape[2], start, int(causal), out.data_ptr(), out.stride(0),
        int(q.dtype == torch.bfloat16), d**-0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention kernel refused its arguments ({rc})")
    return out


def attend_batch_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[torch.Tensor],
                       bounds: list[tuple[int, int, int]]) -> torch.Tensor:
    """Reference of a packed stream. q [T, heads, d]; k, v [T, kv_heads, d]; request b owns
    rows s..e-1 of ``bounds[b] = (s, e, start)`` and its layer's cache ``caches[b]``
    [2, kv_heads, cap, d] float32: each request as ``attend_cached_torch`` (causal) ->
    [T, heads * d]."""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for cache, (s, e, start) in zip(caches, bounds, strict=True):
        out[s:e] = attend_cached_torch(q[s:e], k[s:e], v[s:e], cache, start)
    return out


class BatchArgs:
    """What ``attend_batch`` passes for one packed forward, built once and used by every
    layer: each request's first row, token count, cache base, layer stride, capacity and
    start. ``data`` [n_layers, 2, kv_heads, cap, d] float32 per request (``SeqKV.data``)."""

    def __init__(self, data: list[torch.Tensor], bounds: list[tuple[int, int, int]]):
        B = len(bounds)
        self.B = B
        self.data = data  # keeps the caches alive while their addresses are in use
        self.row0 = (ctypes.c_int64 * B)(*(s for s, _, _ in bounds))
        self.n = (ctypes.c_int64 * B)(*(e - s for s, e, _ in bounds))
        self.start = (ctypes.c_int64 * B)(*(st for _, _, st in bounds))
        self.caches = (ctypes.c_void_p * B)(*(t.data_ptr() for t in data))
        self.layer_stride = (ctypes.c_int64 * B)(*(t.stride(0) for t in data))
        self.cap = (ctypes.c_int64 * B)(*(t.shape[3] for t in data))


def takes_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, data: list[torch.Tensor],
                bounds: list[tuple[int, int, int]]) -> bool:
    """``attend_batch`` serves this stream here: every request's tokens within ``MAX_QUERIES``
    and every cache a contiguous float32 ``SeqKV.data``."""
    return (all(0 < e - s <= MAX_QUERIES for s, e, _ in bounds)
            and all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 5 for t in data)
            and takes(q[:1], k[:1], v[:1], data[0][0]))


def attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BatchArgs, layer: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """As ``attend_batch_torch`` for layer ``layer`` of every request's cache, in one call;
    each request's rows are computed exactly as ``attend_cached`` computes them alone.
    Check ``takes_batch`` first."""
    T, heads, d = q.shape
    if out is None:
        out = torch.empty(T, heads * d, dtype=q.dtype)
    rc = _lib().adaflash_attend_cached_batch(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), args.B, args.row0, args.n,
        args.caches, args.layer_stride, args.cap, args.start, layer, heads, k.shape[1], d, out.data_ptr(),
        out.stride(0), int(q.dtype == torch.bfloat16), d**-0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention kernel refused its arguments ({rc})")
    return out


@functools.cache
def available() -> bool:
    """The library loads here and agrees with the reference: float32 to 1e-5, bfloat16
    outputs within one bfloat16 step, the stored keys and values exactly."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for n, start in ((1, 7), (5, 11)):
            q = torch.randn(n, 6, 16, generator=g).to(dtype)
            k, v = (torch.randn(n, 2, 16, generator=g).to(dtype) for _ in range(2))
            base = torch.randn(2, 2, 24, 16, generator=g)
            c1, c2 = base.clone(), base.clone()
            want = attend_cached_torch(q, k, v, c1, start)
            got = attend_cached(q, k, v, c2, start)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            ok &= torch.allclose(got.float(), want.float(), atol=tol, rtol=tol) and torch.equal(c1, c2)
        # a packed stream of three requests: each row as the lone-request call gives it
        bounds = [(0, 1, 7), (1, 6, 11), (6, 9, 0)]
        q = torch.randn(9, 6, 16, generator=g).to(dtype)
        k, v = (torch.randn(9, 2, 16, generator=g).to(dtype) for _ in range(2))
        data = [torch.randn(3, 2, 2, 24, 16, generator=g) for _ in bounds]
        alone = [t.clone() for t in data]
        got = attend_batch(q, k, v, BatchArgs(data, bounds), 1)
        want = torch.cat([attend_cached(q[s:e], k[s:e], v[s:e], t[1], st)
                          for t, (s, e, st) in zip(alone, bounds, strict=True)])
        ok &= torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(data, alone, strict=True))
    if not ok:
        log.warning("attention kernel disagrees with its reference; not used")
    return bool(ok)
