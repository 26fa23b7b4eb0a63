"""The model runner: one object owns device, precision and threads for target and drafter.

CPU float32, CPU bfloat16 and CUDA bfloat16 are one switch (``model.device``,
``model.dtype``), not one loader per caller: every part that loads the target (the node,
the learner, offline training and evaluation, the benchmarks) asks a ``ModelRunner``.

- ``ModelRunner.serving``: what a node serves in. The device is ``model.device`` (auto:
  CUDA when a GPU is visible); the precision is what ``model.dtype`` resolves to there
  (``dataplane.precision``: bfloat16 on CUDA, measured on CPU).
- ``ModelRunner.training``: the learner's frozen target and drafter, float32 on CPU (the
  learner trains in float32; a drafter trained there is cast when a node loads it).

On CPU the target runs its fused forward (``dataplane.fused_layers``, bfloat16 weights
prepacked for oneDNN) and the verify ops their torch references. On CUDA every tensor of
a step lives on the GPU: the model moves its inputs there (``TargetModel.forward_packed``,
``Drafter.forward_block``), so the verify stream's ops (``dataplane.kernels``: packing,
greedy and rejection acceptance) dispatch to their Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash.config import Settings
from dataplane.drafter import Drafter
from dataplane.kernels import HAS_TRITON, cpu_gemv
from dataplane.model import TargetModel
from dataplane.precision import DTYPES, PrecisionChoice, choose
from dataplane.target_cache import ensure_target


class DeviceUnavailable(RuntimeError):
    """``model.device`` names a device this machine does not have."""


def resolve_device(setting: str) -> torch.device:
    """``model.device`` (auto | cpu | cuda) -> the device to run on."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("model.device is cuda but no CUDA device is visible to this process; "
                                "set model.device to auto or cpu")
    if setting not in ("cpu", "cuda"):
        raise ValueError(f"model.device must be auto, cpu or cuda, not {setting!r}")
    return torch.device(setting)


def apply_cpu_settings(settings: Settings) -> None:
    """Threads from the configuration; compiled CPU kernels kept under the cache directory."""
    cpu_gemv.use_cache_dir(settings.cache / "kernels")
    if settings.model.torch_threads:
        torch.set_num_threads(settings.model.torch_threads)


@dataclass(frozen=True)
class ModelRunner:
    device: torch.device
    dtype: torch.dtype
    reason: str = ""  # why this precision (served precision choice, or "training")

    @classmethod
    def serving(cls, settings: Settings) -> ModelRunner:
        """Device and precision nodes serve in on this machine (the CPU choice is cached)."""
        apply_cpu_settings(settings)
        device = resolve_device(settings.model.device)
        choice = choose(settings.model.dtype, device.type, settings.cache)
        return cls(device, choice.torch_dtype, choice.reason)

    @classmethod
    def training(cls, settings: Settings | None = None) -> ModelRunner:
        """The learner's: float32 on CPU, whatever the nodes serve in."""
        if settings is not None:
            apply_cpu_settings(settings)
        return cls(torch.device("cpu"), torch.float32, "training")

    @classmethod
    def of(cls, target: TargetModel) -> ModelRunner:
        """The runner a loaded target runs on (what a drafter bound to it must match)."""
        w = target.lm_head.weight
        return cls(w.device, w.dtype, "the target's")

    @classmethod
    def reference(cls, dtype: torch.dtype | str = torch.float32) -> ModelRunner:
        """A fixed CPU precision (benchmarks comparing precisions, tools)."""
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        return cls(torch.device("cpu"), dtype, "set by the caller")

    @property
    def triton_verify(self) -> bool:
        """True when the verify stream's ops run in the Triton kernels (CUDA with Triton)."""
        return self.device.type == "cuda" and HAS_TRITON

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> dict:
        return {"device": str(self.device), "dtype": self.precision, "reason": self.reason,
                "verify_kernels": "triton" if self.triton_verify else "torch"}

    def load_target(self, target_dir: str | Path) -> TargetModel:
        """The target from a Hugging Face directory, on this runner's device and precision."""
        return TargetModel.from_pretrained(target_dir, dtype=self.dtype, device=self.device)

    def place(self, drafter: Drafter) -> Drafter:
        """A drafter moved to this runner's device and precision (index buffers stay int64)."""
        drafter.to(dtype=self.dtype, device=self.device)
        drafter.vocab_map = drafter.vocab_map.to(torch.int64)
        drafter.rotary.inv_freq = drafter.rotary.inv_freq.float()
        return drafter


def serving_precision(settings: Settings, device: str | None = None) -> PrecisionChoice:
    """The precision nodes on this machine serve in (``device``: default ``model.device``)."""
    apply_cpu_settings(settings)
    dev = resolve_device(device or settings.model.device)
    return choose(settings.model.dtype, dev.type, settings.cache)


def load_target(settings: Settings, target_dir: Path | None = None) -> TargetModel:
    """The target as nodes serve it (``ModelRunner.serving``)."""
    return ModelRunner.serving(settings).load_target(target_dir or ensure_target(settings))


def load_training_target(settings: Settings, *, cpu_settings: bool = True) -> tuple[Path, TargetModel]:
    """The converted target directory and the target on ``ModelRunner.training`` (the learner,
    offline training and evaluation, the adaptation bench). ``cpu_settings=False`` leaves
    threads and the kernel cache as the caller set them (a command's ``--threads``)."""
    d = ensure_target(settings)
    return d, ModelRunner.training(settings if cpu_settings else None).load_target(d)
