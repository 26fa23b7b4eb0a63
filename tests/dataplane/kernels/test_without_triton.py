"""A CPU-only install without Triton still imports the kernels and verifies with torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from dataplane import kernels
from dataplane.verify import verify

assert not kernels.HAS_TRITON
cu = torch.tensor([0, 2, 3])
token_ids = torch.tensor([1, 4, 3])
logits = torch.zeros(3, 10)
logits[0, 4] = logits[1, 6] = logits[2, 2] = 1.0
result = verify(logits, token_ids, cu, torch.zeros(2))
assert result.accepted.tolist() == [1, 0] and result.bonus.tolist() == [6, 2], result

try:
    kernels.greedy_accept_triton(logits, token_ids, cu)
except RuntimeError as err:
    assert "not available" in str(err)
else:
    raise AssertionError("launching a kernel without triton must fail loudly")
print("ok")
"""


def test_torch_path_without_triton():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ADAFLASH_FORCE_TRITON")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
