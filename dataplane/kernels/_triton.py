"""Guarded Triton import.

The kernels are written against ``triton`` / ``triton.language`` as usual. When Triton
cannot be imported (a CPU-only install), small stand-ins keep the kernel definitions
importable; launching one then raises, and the dispatcher never tries because
``HAS_TRITON`` is False.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means "no Triton here"
    HAS_TRITON = False

    class _UnavailableKernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"Triton is not available: cannot launch {self.fn.__name__}")

    class _TritonStandIn:
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            if fn is None:
                return _UnavailableKernel
            return _UnavailableKernel(fn)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

    class _LanguageStandIn:
        constexpr = Any  # only used in kernel signatures

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _LanguageStandIn()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "tl", "triton"]
