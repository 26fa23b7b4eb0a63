"""What a throughput figure was measured on, and the bound the machine sets for one step.

A decode step reads every weight of the target (and, when drafting, of the drafter)
once, so on a CPU its time is at least weight bytes / read bandwidth: the
weight-streaming bound every step time is reported against.
"""

from __future__ import annotations

import os
import time

import torch

from dataplane.precision import cpu_flags, cpu_model

BANDWIDTH_BYTES = 512 * 1024 * 1024  # far larger than any cache
BANDWIDTH_REPEATS = 7


def read_bandwidth_gbs(threads: int | None = None) -> float:
    """Sustained read bandwidth in GB/s: the best of a few sums over a 512 MiB buffer."""
    buf = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(BANDWIDTH_REPEATS):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    del buf
    return BANDWIDTH_BYTES / best / 1e9


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of distinct parameter storage (tied weights counted once)."""
    seen, total = set(), 0
    for p in module.parameters():
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += p.untyped_storage().nbytes()
    return total


def describe(precision_choice) -> dict:
    """Machine facts for result.json: CPU, flags, threads, bandwidth, served precision."""
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "read_bandwidth_gbs": round(read_bandwidth_gbs(), 2),
        "served_precision": precision_choice.dtype,
        "precision_reason": precision_choice.reason,
        "precision_probe_ms": precision_choice.probe_ms,
        "cpu_kernels": cpu_kernels(),
    }


def cpu_kernels() -> dict:
    """Which of our CPU kernels serve products here (each only where it measured faster), and
    whether float32 and bfloat16 steps run every layer in one C call."""
    from dataplane.kernels import cpu_forward, cpu_forward_bf16
    from dataplane.kernels.cpu_linear import kernel_plan

    plan = kernel_plan()
    return {**plan.describe(), "forward_f32_layers": plan.gemv_f32 and cpu_forward.available(),
            "forward_bf16_layers": cpu_forward_bf16.available()}


def bound_ms(nbytes: int, bandwidth_gbs: float) -> float:
    """Time to stream ``nbytes`` once at ``bandwidth_gbs``."""
    return nbytes / (bandwidth_gbs * 1e9) * 1e3
