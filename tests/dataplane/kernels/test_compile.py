"""Every kernel compiles for a real GPU (sm_90), even where only the interpreter can run it.

The CPU interpreter is lenient about things the compiler rejects (mixed scalar types in
loop-carried values, mask dtypes); compiling ahead of time catches those without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataplane.kernels import HAS_TRITON
from tests.dataplane.kernels.compile_kernels import KERNELS, TOOLCHAIN_MISSING

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_sm90():
    # A separate process: compiling is not possible while TRITON_INTERPRET=1 is in effect.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.dataplane.kernels.compile_kernels"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == TOOLCHAIN_MISSING:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == len(KERNELS)
