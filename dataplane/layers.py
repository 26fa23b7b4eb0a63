"""Building blocks shared by the target model and the drafter: norm, rotary, MLP.

Names of parameters follow Hugging Face's Llama/Qwen3 so that weights load as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D], computed in float32 like the reference implementation."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding with a cos/sin table grown on demand."""

    def __init__(self, head_dim: int, theta: float, max_len: int = 4096):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(max_len)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, head_dim]."""
        need = int(positions.max().item()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0] or self._cos.device != positions.device:
            self._cos = self._cos.to(positions.device)
            self._build(max(need, 2 * self._cos.shape[0]))
        return self._cos[positions], self._sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, head_dim] -> rotated x (same shape)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def chunked_linear(layer: nn.Linear, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``layer(x)`` for x [M, K] computed as matrix products of exactly ``rows`` rows each.

    The BLAS picks its kernel (and how it splits the work between threads) from the
    shape of the product, so a row's result depends on how many other rows share the
    product (a vector product for one row, other kernels for few or many rows). Every
    product here has the same shape, so a row's result depends on that row alone. The
    last chunk is padded with zero rows; M is usually a multiple of ``rows`` already
    (the batch-invariant forward pads the whole stream once).
    """
    m, k = x.shape
    pad = (-m) % rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    w = layer.weight.t()
    out = x.new_empty(m + pad, layer.out_features)
    for i in range(0, m + pad, rows):
        if layer.bias is None:
            torch.mm(x[i : i + rows], w, out=out[i : i + rows])
        else:
            torch.addmm(layer.bias, x[i : i + rows], w, out=out[i : i + rows])
    return out[:m] if pad else out


def silu_exact(x: torch.Tensor) -> torch.Tensor:
    """SiLU from exp, division and addition only.

    ``F.silu`` rounds differently on its vectorised path and on its scalar path (the
    elements left over at the end of a tensor or of a thread's share), so an element's
    result would depend on the tensor's size; exp, add and divide give the same bits on both.
    """
    return x / (1.0 + torch.exp(-x))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """rows > 0: batch-invariant numerics (products of ``rows`` rows, see chunked_linear)."""
        if rows:
            g = chunked_linear(self.gate_proj, x, rows)
            return chunked_linear(self.down_proj, silu_exact(g) * chunked_linear(self.up_proj, x, rows), rows)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
