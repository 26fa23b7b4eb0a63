"""y = x W^T for one to four rows in bfloat16 on CPU: a kernel of our own (``gemv_bf16.c``).

A decode step multiplies one row by every weight matrix, and oneDNN's prepacked product
(``dataplane.kernels.cpu_linear``) pays a fixed cost per call that a small matrix cannot
hide. Measured on a 2-core Xeon with AMX-BF16 (all 121 fused matrices of one SmolLM2-135M
forward, weights cycled so none stays in L2, two threads): prepacked oneDNN 16.7 ms for one
row, 17.1 ms for two; this kernel 9.7 ms and 11.0 ms, at the weight-streaming bound (9.6 ms
at the 28 GB/s the machine reads). It streams each weight row once with AVX512-BF16 dot
products and software prefetch, on the OpenMP threads PyTorch already runs.

The kernel is compiled here at first use (gcc, about a second) into the cache directory
and used only where it pays: the CPU has AVX512-BF16, the build and a check against
``gemv_torch`` succeed, and one probe product runs faster than the prepacked one (``pays``).
``ADAFLASH_CPU_GEMV=0`` turns it off. Nodes keep the build under their cache directory
(``use_cache_dir``), so a restart loads it without compiling, and the probe's verdict beside
it (``kept_verdict``): the probe of a kernel close to oneDNN's time gave either answer from
one start to the next (1.26 and 1.04 ms for the same products on one machine), so nodes on
one machine chose differently; a verdict measured on a quiet machine is kept per CPU,
threads, torch and kernel source. ``gemv_torch`` is the reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dataplane.kernels.cpu_info import cpu_flags, cpu_model, machine_busy

log = logging.getLogger("adaflash.kernels")

SOURCE = Path(__file__).with_name("gemv_bf16.c")
MAX_ROWS = 4  # rows of x the kernel takes; more rows go to oneDNN (AMX / AVX512 GEMM)
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "ADAFLASH_CPU_GEMV"


def gemv_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference: x [M, K] bf16 @ weight [N, K]^T -> [M, N] bf16, accumulated in float32."""
    return (x.float() @ weight.float().t()).to(torch.bfloat16)


_CACHE: dict[str, Path | None] = {"dir": None}


def use_cache_dir(path: Path) -> None:
    """Keep the compiled kernel under ``path`` (the node's cache directory), across restarts."""
    _CACHE["dir"] = Path(path)


def _cache_dir() -> Path:
    """The cache directory the runner set, else a directory of this process's own."""
    if _CACHE["dir"] is None:
        _CACHE["dir"] = Path(tempfile.mkdtemp(prefix="adaflash-kernels-"))
    return _CACHE["dir"]


def build_kernel(source: Path = SOURCE, cflags: list[str] = CFLAGS, also: tuple[Path, ...] = ()) -> Path:
    """The compiled ``source`` (linked with the sources ``also``), built once per sources,
    flags and compiler into the cache directory."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler")
    src = b"".join(p.read_bytes() for p in (source, *also, *sorted(source.parent.glob("*.h"))))  # and headers
    torch_lib = Path(torch.__file__).parent / "lib"  # link the OpenMP runtime PyTorch loaded
    key = hashlib.sha256(src + " ".join([cc, *cflags, str(torch_lib)]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        subprocess.run([cc, *cflags, "-o", str(so), str(source), *map(str, also), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"],
                       check=True, capture_output=True, timeout=120)
        os.replace(so, out)  # atomic: nodes starting together never load a half-written file
    return out


def load_kernel(source: Path, cflags: list[str], label: str, also: tuple[Path, ...] = ()):
    """``source`` (and ``also``) built and loaded (``ctypes.CDLL``), or None where that fails here (logged)."""
    try:
        return ctypes.CDLL(str(build_kernel(source, cflags, also)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.info("%s not available (%s); oneDNN serves every product", label, e)
        return None


def bind_product(fn):
    """Typed ``fn(x, ldx, M, w, N, K, y, ldy, threads) -> int``, the signature of both kernels."""
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _lib():
    """The loaded kernel, or None where it cannot be used here (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = load_kernel(SOURCE, CFLAGS, "bfloat16 GEMV kernel")
    return None if lib is None else bind_product(lib.adaflash_gemv_bf16)


def takes_weight(weight: torch.Tensor) -> bool:
    """Weights the kernel takes: [N, K] contiguous bf16 on CPU with K % 32 == 0."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % 32 == 0)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes and layouts the kernel takes: x [M <= 4, K] bf16 with unit column stride, and
    a weight it takes (``takes_weight``) of the same K."""
    return (takes_weight(weight) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.shape[1] == weight.shape[1] and x.stride(1) == 1)


def call_product(fn, x: torch.Tensor, weight: torch.Tensor, label: str) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype through a kernel of ``bind_product``'s
    signature on PyTorch's threads; a refusal (non-zero return) raises ValueError."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, y.data_ptr(), n, torch.get_num_threads())
    if rc:
        raise ValueError(f"{label} refused x {tuple(x.shape)} weight {tuple(weight.shape)}")
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] bf16 with the kernel (callers check ``available``
    and ``supported``)."""
    return call_product(_lib(), x, weight, "gemv_bf16")


@functools.cache
def available() -> bool:
    """The kernel loads here and agrees with the reference (bf16 rounding of the output)."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(203, 96, generator=g) * 0.1).to(torch.bfloat16)
    for m in range(1, MAX_ROWS + 1):
        x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
        ref = gemv_torch(x, w).float()
        if not torch.allclose(gemv(x, w).float(), ref, atol=1e-2, rtol=1e-2):
            log.warning("bfloat16 GEMV kernel disagrees with the reference; not used")
            return False
    return True


def onednn_product() -> tuple[Callable, Callable]:
    """oneDNN's prepacked product as (product(x, laid_out), layout(w)), the baseline every kernel must beat."""
    from dataplane.kernels.cpu_linear import mkldnn_packed

    return (lambda x, q: torch.ops.mkldnn._linear_pointwise(x, q, None, "none", [], "")), mkldnn_packed


def beats(kernel, layout, rows: int, margin: float, label: str, baseline: tuple[Callable, Callable] | None = None,
          baseline_label: str = "oneDNN", dtype: torch.dtype = torch.bfloat16) -> bool:
    """True if ``kernel(x, layout(w))`` of ``rows`` rows takes under ``margin`` times ``baseline``
    (product, layout; default oneDNN's prepacked product) over 8 matrices of the model's shape
    in ``dtype`` (so none stays in L2), fastest of five turns each, turns interleaved."""
    from dataplane.kernels.cpu_linear import mkldnn_packing_works

    if baseline is None:
        if not mkldnn_packing_works(torch.bfloat16):
            return True
        baseline = onednn_product()
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(1536, 576, generator=g) * 0.05).to(dtype) for _ in range(8)]
    laid = {"kernel": (kernel, [layout(w) for w in ws]), "baseline": (baseline[0], [baseline[1](w) for w in ws])}
    x = torch.randn(rows, 576, generator=g).to(dtype)
    best = {"kernel": float("inf"), "baseline": float("inf")}
    for _ in range(5):
        for name, (product, weights) in laid.items():
            t0 = time.perf_counter()
            for w in weights:
                product(x, w)
            best[name] = min(best[name], time.perf_counter() - t0)
    log.info("%s %.3f ms, %s %.3f ms (8 products of %d rows)", label, 1e3 * best["kernel"], baseline_label,
             1e3 * best["baseline"], rows)
    return best["kernel"] < margin * best["baseline"]


def verdict_file(source: Path, probe: str = "") -> Path:
    """Where the verdict of ``probe`` on ``source`` is kept: one file per probe, CPU, flags,
    threads, torch and kernel source."""
    key = json.dumps([source.name, probe, hashlib.sha256(source.read_bytes()).hexdigest(), cpu_model(),
                      cpu_flags(), torch.__version__, torch.get_num_threads()])
    return _cache_dir() / "verdicts" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def kept_verdict(source: Path, measure: Callable[[], bool], probe: str = "") -> bool:
    """``measure()``'s answer (the probe named ``probe``) for the kernel built from ``source``,
    measured once per machine.

    A verdict in the cache directory is read back; otherwise ``measure`` decides and its
    answer is kept, unless the machine is busier than its cores (then it holds for this
    process only and the next start measures again).
    """
    path = verdict_file(source, probe)
    try:
        kept = json.loads(path.read_text())["pays"]
        if isinstance(kept, bool):
            return kept
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = bool(measure())
    if not machine_busy():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"pays": result, "measured": time.time()}))
        os.replace(tmp, path)  # atomic: nodes starting together read a whole verdict or none
    return result


@functools.cache
def pays() -> bool:
    """One row through the kernel beats oneDNN's prepacked product (``beats``), as kept for this machine."""
    return available() and kept_verdict(SOURCE, lambda: beats(gemv, lambda w: w, 1, 0.9, "bfloat16 GEMV kernel"))
