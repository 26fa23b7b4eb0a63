"""Which precision a node serves in, chosen by measuring the machine (``model.dtype: auto``).

A decode step streams every weight once, so halving the bytes (bfloat16) halves the
bound, but only where the CPU multiplies bfloat16 natively: with AVX512-BF16 or AMX a
one-row bfloat16 product of the model's shapes ran in 0.6x the float32 time; on an
AVX2-only CPU the same product ran about 100x slower than float32. No fixed choice is
right, so ``auto`` reads the CPU flags and times the product both ways on a few
matrices of the target's shapes, and serves bfloat16 only when it is clearly faster.
On CUDA the answer is bfloat16. The decision is cached per machine under the cache
directory (CPU model, flags, torch version), so a restart does not measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dataplane.kernels.cpu_info import cpu_flags, cpu_model, machine_busy
from dataplane.kernels.cpu_linear import PackedLinear

log = logging.getLogger("adaflash.precision")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# bfloat16 is served when its probe step takes at most this share of float32's.
BF16_WIN_RATIO = 0.85
PROBE_SHAPES = ((960, 576), (3072, 576), (576, 1536), (576, 576))  # SmolLM2-135M's fused layer
PROBE_LAYERS = 6
PROBE_REPEATS = 9
# A ratio between these is too close to call: decided for this start only, measured again next start.
UNDECIDED = (BF16_WIN_RATIO, 1.15)


@dataclass
class PrecisionChoice:
    dtype: str  # "float32" | "bfloat16" | "float16"
    reason: str
    cpu_flags: list[str]
    probe_ms: dict[str, float]  # one probe pass per candidate dtype (median)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _probe_layers(dtype: torch.dtype) -> tuple[list[PackedLinear], dict[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    lins = [PackedLinear((torch.randn(n, k, generator=g) * 0.02).to(dtype))
            for _ in range(PROBE_LAYERS) for n, k in PROBE_SHAPES]
    return lins, {k: torch.randn(1, k, generator=g).to(dtype) for _, k in PROBE_SHAPES}


def probe_ms(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
             repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Fastest time of one row through PROBE_LAYERS copies of the probe shapes, per dtype, in ms.

    The dtypes take turns in every round, so a busy spell of a shared machine slows them
    alike, and each keeps its fastest round: a decision taken beside other load (a build,
    a test run) must not differ from one taken on a quiet machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: threads meeting at barriers on a busy machine would decide instead
    try:
        setups = {dt: _probe_layers(dt) for dt in dtypes}
        best = {dt: float("inf") for dt in dtypes}
        for r in range(repeats + 2):
            for dt, (lins, xs) in setups.items():
                t0 = time.perf_counter()
                for lin in lins:
                    lin(xs[lin.weight.shape[1]])
                if r >= 2:  # the first rounds pay for oneDNN's kernel generation
                    best[dt] = min(best[dt], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {str(dt).removeprefix("torch."): 1e3 * t for dt, t in best.items()}


def probe(flags: list[str] | None = None) -> PrecisionChoice:
    """Measure this machine and choose (CPU only)."""
    flags = cpu_flags() if flags is None else flags
    if not any(f in flags for f in BF16_FLAGS):
        return PrecisionChoice("float32", "no AVX512-BF16/AMX: bfloat16 products are emulated", flags, {})
    ms = probe_ms()
    if ms["bfloat16"] <= BF16_WIN_RATIO * ms["float32"]:
        return PrecisionChoice("bfloat16", f"bfloat16 probe {ms['bfloat16']:.2f} ms vs float32 "
                               f"{ms['float32']:.2f} ms", flags, ms)
    return PrecisionChoice("float32", f"bfloat16 does not pay here ({ms['bfloat16']:.2f} ms vs "
                           f"{ms['float32']:.2f} ms)", flags, ms)


def _cache_file(cache_dir: Path) -> Path:
    key = json.dumps([cpu_model(), cpu_flags(), torch.__version__, torch.get_num_threads()])
    return cache_dir / "precision" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def choose(setting: str, device: str | torch.device = "cpu", cache_dir: Path | None = None) -> PrecisionChoice:
    """Resolve ``model.dtype`` (``auto`` | ``float32`` | ``bfloat16`` | ``float16``)."""
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"model.dtype must be auto, float32, bfloat16 or float16, not {setting!r}")
        return PrecisionChoice(setting, "set in the configuration", cpu_flags(), {})
    if torch.device(device).type == "cuda":
        return PrecisionChoice("bfloat16", "CUDA serves bfloat16", [], {})
    path = _cache_file(cache_dir) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return PrecisionChoice(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            log.warning("ignoring unreadable precision cache %s", path)
    choice = probe()
    log.info("served precision: %s (%s)", choice.dtype, choice.reason)
    ratio = choice.probe_ms["bfloat16"] / choice.probe_ms["float32"] if choice.probe_ms else None
    undecided = ratio is not None and (UNDECIDED[0] < ratio < UNDECIDED[1] or machine_busy())
    if path is not None and not undecided:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(choice)))
    return choice
