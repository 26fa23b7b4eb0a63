"""Per-sequence KV cache that grows on demand.

A sequence's keys and values for every layer live in one tensor
``data [layers, 2, kv_heads, capacity, head_dim]`` so that the first ``length``
positions of a layer are a strided view usable by attention without a copy.
Rejected draft positions are dropped by ``truncate`` (later writes overwrite them).
"""

from __future__ import annotations

import torch


class SeqKV:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 64):
        self.data = torch.empty(n_layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.recent: torch.Tensor | None = None  # a drafter's cache: its newest context feature [H]

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (amortised doubling)."""
        if total <= self.capacity:
            return
        cap = self.capacity
        while cap < total:
            cap *= 2
        new = torch.empty(*self.data.shape[:3], cap, self.data.shape[4], dtype=self.data.dtype,
                          device=self.data.device)
        new[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = new

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, kv_heads, head_dim] stored at positions start .. start+n-1."""
        n = k.shape[0]
        self.data[layer, 0, :, start : start + n] = k.transpose(0, 1)
        self.data[layer, 1, :, start : start + n] = v.transpose(0, 1)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end): each [kv_heads, end, head_dim]."""
        return self.data[layer, 0, :, :end], self.data[layer, 1, :, :end]

    def truncate(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
