"""Compile every verify kernel for sm_90 ahead of time (no GPU needed): ``python -m tests.dataplane.kernels.compile_kernels``.

Run without TRITON_INTERPRET (the interpreter replaces triton.jit). Prints one line per
kernel and exits non-zero on the first failure; exits 77 when the compiler toolchain
(NVIDIA backend or ptxas) is missing.
"""

from __future__ import annotations

import importlib
import sys

I64 = "*i64"
KERNELS = {
    "pack": (
        "dataplane.kernels.pack",
        "_pack_drafts_kernel",
        {
            "last_tokens_ptr": I64,
            "drafts_ptr": I64,
            "drafts_stride": "i64",
            "k_hat_ptr": I64,
            "seq_lens_ptr": I64,
            "cu_seqlens_ptr": I64,
            "token_ids_ptr": I64,
            "positions_ptr": I64,
        },
        {"BLOCK_K": 32},
    ),
    "argmax": (
        "dataplane.kernels.greedy",
        "_row_argmax_kernel",
        {"logits_ptr": "*bf16", "logits_stride": "i64", "argmax_ptr": I64, "V": "i32"},
        {"BLOCK_V": 1024},
    ),
    "greedy": (
        "dataplane.kernels.greedy",
        "_greedy_accept_kernel",
        {
            "argmax_ptr": I64,
            "token_ids_ptr": I64,
            "cu_seqlens_ptr": I64,
            "accepted_ptr": I64,
            "bonus_ptr": I64,
        },
        {"BLOCK_K": 32},
    ),
    "rejection": (
        "dataplane.kernels.rejection",
        "_rejection_kernel",
        {
            "p_ptr": "*fp32",
            "p_stride": "i64",
            "q_ptr": "*bf16",
            "q_stride": "i64",
            "token_ids_ptr": I64,
            "cu_seqlens_ptr": I64,
            "uniforms_ptr": "*fp32",
            "bonus_uniforms_ptr": "*fp32",
            "accepted_ptr": I64,
            "bonus_ptr": I64,
            "V": "i32",
        },
        {"BLOCK_K": 32, "BLOCK_V": 1024},
    ),
}
TOOLCHAIN_MISSING = 77


def main() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        print(f"toolchain missing: {err}")
        return TOOLCHAIN_MISSING
    target = GPUTarget("cuda", 90, 32)
    for name, (module, kernel_name, signature, constexprs) in KERNELS.items():
        kernel = getattr(importlib.import_module(module), kernel_name)
        full_signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(fn=kernel, signature=full_signature, constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=target)
        except (RuntimeError, FileNotFoundError) as err:
            if "ptxas" in str(err).lower():
                print(f"toolchain missing: {err}")
                return TOOLCHAIN_MISSING
            raise
        print(f"{name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
