"""Attention of a packed stream: requests batched together, each over its own cache.

A verify or decode stream holds many requests with a few new tokens each. Attending
request by request costs a handful of small kernels per request and layer, which on a
CPU is mostly per-call overhead: 16 requests of 4 tokens cost visibly more than one
request of 64. Here requests of a few tokens are grouped (sorted by length, so that
padding stays small) and a group attends with three kernels per layer: its queries and
cached keys/values are laid out padded, [G * kv_heads, n_max * g, .], and an additive
mask built once per forward hides both what lies after a query and the padding.
Requests with many new tokens (prompts) attend on their own (``attention.attend``); a
lone request of a few (a verify at C=1) uses a causal mask built once per forward, not
once per layer (measured on a 2-core AMD EPYC with AVX512-BF16: 16 queries over 144
keys, 150 us a layer with the mask built each time, 84 us with it shared).

The plan (groups, masks, gather indices, padded key buffers) depends only on the shape
of the stream, so it is built once per forward and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dataplane.attention import SMALL_QUERIES, additive_mask, attend, attend_few, offset_mask
from dataplane.kernels import cpu_attention
from dataplane.kv_cache import SeqKV

GROUP_POSITIONS = 65536  # a group's padded keys: members x longest cache at most
GROUP_MAX = 64  # requests per group at most


@dataclass
class _Group:
    members: list[tuple[int, int, int, int]]  # (request, stream start, stream end, cache start)
    n_max: int
    l_max: int
    q_src: torch.Tensor  # [G * n_max] stream row of each padded query slot
    slot_rows: torch.Tensor  # [sum n] padded slots that are real tokens
    stream_rows: torch.Tensor  # [sum n] their stream rows
    mask: torch.Tensor  # [G * kv_heads, n_max * g, l_max] additive, 0 or -inf
    kv_buf: torch.Tensor  # [2, G, kv_heads, l_max, d]; padding stays zero


class StreamPlan:
    """How one packed forward attends; built by ``TargetModel`` once per call.

    bounds: per request (stream start, stream end, cache start), as the model's forward.
    fast: a lone request of a few tokens attends through ``kernels.cpu_attention`` where it
    takes the shapes (the serving forward); off, through PyTorch (the reference path).
    """

    def __init__(self, bounds: list[tuple[int, int, int]], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fast: bool = False):
        self.fast = fast and device.type == "cpu"
        self._kernel: bool | None = None  # decided at the first layer: every layer has the same shapes
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.g = heads // kv_heads
        self.singles: list[tuple[int, int, int, int]] = []
        few = []
        for b, (s, e, start) in enumerate(bounds):
            (few if e - s <= SMALL_QUERIES else self.singles).append((b, s, e, start))
        self.bounds = bounds
        self._batch: cpu_attention.BatchArgs | bool | None = None  # decided at the first layer
        chunks = [[few[i] for i in idx] for idx in _chunks([st + e - s for _, s, e, st in few], 0)]
        self.singles += [c[0] for c in chunks if len(c) == 1]
        self._chunks = [c for c in chunks if len(c) > 1]
        self._groups: list[_Group] | None = None
        self._dtype, self._device = dtype, device
        # a lone request of a few tokens (a verify at C=1): its mask once, not once per layer
        self.single_masks = {b: offset_mask(e - s, st + e - s, self.g, kv_heads, dtype, device)
                             for b, s, e, st in self.singles if 1 < e - s <= SMALL_QUERIES}

    @property
    def groups(self) -> list[_Group]:
        """The padded groups, laid out on first use (a stream the batched kernel takes needs none)."""
        if self._groups is None:
            self._groups = [self._group(c, self._dtype, self._device) for c in self._chunks]
        return self._groups

    def _group(self, members, dtype, device) -> _Group:
        G = len(members)
        n = torch.tensor([e - s for _, s, e, _ in members])
        s0 = torch.tensor([s for _, s, _, _ in members])
        start = torch.tensor([st for *_, st in members])
        n_max, l_max = int(n.max()), int((start + n).max())
        i = torch.arange(n_max).unsqueeze(0)  # [1, n_max]
        real = i < n.unsqueeze(1)  # [G, n_max]
        last = torch.minimum(i, n.unsqueeze(1) - 1)  # padded slots repeat the last token
        q_src = (s0.unsqueeze(1) + last).reshape(-1)
        q_pos = start.unsqueeze(1) + last  # [G, n_max] absolute position of each query
        see = torch.arange(l_max).view(1, 1, l_max) <= q_pos.unsqueeze(2)  # [G, n_max, l_max]
        see = see.repeat_interleave(self.g, dim=1)  # rows in (token, group member) order
        mask = additive_mask(see, dtype)
        mask = mask.unsqueeze(1).expand(G, self.kv_heads, n_max * self.g, l_max)
        slots = torch.arange(G * n_max).view(G, n_max)
        return _Group(
            members=members, n_max=n_max, l_max=l_max, q_src=q_src.to(device),
            slot_rows=slots[real].to(device), stream_rows=(s0.unsqueeze(1) + i)[real].to(device),
            mask=mask.reshape(G * self.kv_heads, n_max * self.g, l_max).to(device),
            kv_buf=torch.zeros(2, G, self.kv_heads, l_max, self.head_dim, dtype=dtype, device=device),
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kvs: list[SeqKV]) -> torch.Tensor:
        """q [T, heads, d], k, v [T, kv_heads, d] of this layer -> [T, heads * d].

        Writes each request's new keys and values into its cache first.
        """
        T, d = q.shape[0], self.head_dim
        kvh, g = self.kv_heads, self.g
        dtype = q.dtype
        if self.fast and self._chunks and self._batch_takes(q, k, v, kvs):
            return cpu_attention.attend_batch(q, k, v, self._batch, layer)
        if self.fast and not self._chunks and self._kernel_takes(layer, q, k, v, kvs):
            out = q.new_empty(T, self.heads * d)
            for b, s, e, start in self.singles:
                cpu_attention.attend_cached(q[s:e], k[s:e], v[s:e], kvs[b].data[layer], start, out=out[s:e])
            return out
        q = q.to(kvs[0].data.dtype) if kvs else q  # attention runs in the cache's precision
        out = q.new_empty(T, self.heads * d)
        kv_new = torch.stack((k, v)).transpose(1, 2)  # [2, kv_heads, T, d]
        for b, s, e, start in self.singles:
            kv = kvs[b]
            kv.data[layer, :, :, start : start + e - s] = kv_new[:, :, s:e]
            kc, vc = kv.view(layer, start + e - s)
            if e - s <= SMALL_QUERIES:
                out[s:e] = attend_few(q[s:e], kc, vc, self.single_masks.get(b)).reshape(e - s, -1)
            else:
                out[s:e] = attend(q[s:e], kc, vc, causal=True).reshape(e - s, -1)
        if not self.groups:
            return out.to(dtype)
        qs = q * (d**-0.5)
        for grp in self.groups:
            G = len(grp.members)
            for j, (b, s, e, start) in enumerate(grp.members):
                cache = kvs[b].data[layer]  # [2, kv_heads, cap, d]
                cache[:, :, start : start + e - s] = kv_new[:, :, s:e]
                grp.kv_buf[:, j, :, : start + e - s] = cache[:, :, : start + e - s]
            qg = qs[grp.q_src].view(G, grp.n_max, kvh, g, d).transpose(1, 2).reshape(G * kvh, grp.n_max * g, d)
            keys = grp.kv_buf[0].view(G * kvh, grp.l_max, d)
            vals = grp.kv_buf[1].view(G * kvh, grp.l_max, d)
            probs = torch.softmax(torch.baddbmm(grp.mask, qg, keys.transpose(1, 2)), dim=-1)
            og = torch.bmm(probs, vals).view(G, kvh, grp.n_max, g, d).transpose(1, 2).reshape(G * grp.n_max, -1)
            out.index_copy_(0, grp.stream_rows, og.index_select(0, grp.slot_rows))
        return out.to(dtype)

    def _batch_takes(self, q, k, v, kvs) -> bool:
        """Many requests of a few tokens each (decode or verify at C > 1): every layer's
        attention is one call of the batched kernel, with no padded copy of the caches."""
        if self._batch is None:
            data = [kv.data for kv in kvs]
            self._batch = (cpu_attention.BatchArgs(data, self.bounds)
                           if cpu_attention.takes_batch(q, k, v, data, self.bounds) else False)
        return self._batch is not False

    def _kernel_takes(self, layer, q, k, v, kvs) -> bool:
        if self._kernel is None:
            self._kernel = all(cpu_attention.takes(q[s:e], k[s:e], v[s:e], kvs[b].data[layer])
                               for b, s, e, _ in self.singles)
        return self._kernel


def _chunks(lengths: list[int], per_member_extra: int) -> list[list[int]]:
    """Indices sorted by length, cut into groups within GROUP_MAX and GROUP_POSITIONS."""
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    out: list[list[int]] = []
    for b in order:
        total = lengths[b] + per_member_extra
        if out and len(out[-1]) < GROUP_MAX and (len(out[-1]) + 1) * total <= GROUP_POSITIONS:
            out[-1].append(b)
        else:
            out.append([b])
    return out


class BlockPlan:
    """The drafter's block attention for B requests, batched like ``StreamPlan``.

    Request b's block of k queries sees its whole context cache (kvs[b].length keys) and
    its own k block keys (non-causal). In a group the block keys sit after the longest
    context, [l_max, l_max + k), and the mask hides the context padding; keys carry their
    rotary phase already, so their order is immaterial.
    """

    def __init__(self, lengths: list[int], k: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.k, self.heads, self.kv_heads, self.head_dim = k, heads, kv_heads, head_dim
        self.g = heads // kv_heads
        self.lengths = lengths
        self.groups = []
        for members in _chunks(lengths, k):
            G = len(members)
            ctx = torch.tensor([lengths[b] for b in members])
            l_max = int(ctx.max())
            c = torch.arange(l_max + k).view(1, -1)
            see = (c < ctx.view(-1, 1)) | (c >= l_max)  # [G, l_max + k]
            mask = additive_mask(see, dtype)
            mask = mask.view(G, 1, 1, l_max + k).expand(G, kv_heads, k * self.g, l_max + k)
            rows = (torch.tensor(members).view(-1, 1) * k + torch.arange(k)).reshape(-1)
            self.groups.append((members, l_max, rows.to(device),
                                mask.reshape(G * kv_heads, k * self.g, l_max + k).to(device),
                                torch.zeros(2, G, kv_heads, l_max + k, head_dim, dtype=dtype, device=device)))

    def attend(self, layer: int, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor,
               kvs: list[SeqKV]) -> torch.Tensor:
        """q [B*k, heads, d]; bk, bv [B*k, kv_heads, d] -> [B*k, heads * d]."""
        k, kvh, g, d = self.k, self.kv_heads, self.g, self.head_dim
        out = q.new_empty(q.shape[0], self.heads * d)
        qs = q * (d**-0.5)
        for members, l_max, rows, mask, buf in self.groups:
            G = len(members)
            if G == 1:
                b = members[0]
                ck, cv = kvs[b].view(layer, self.lengths[b])
                s = b * k
                out[s : s + k] = attend(q[s : s + k], ck, cv, causal=False, extra_k=bk[s : s + k].transpose(0, 1),
                                        extra_v=bv[s : s + k].transpose(0, 1)).reshape(k, -1)
                continue
            for j, b in enumerate(members):
                n = self.lengths[b]
                buf[:, j, :, :n] = kvs[b].data[layer, :, :, :n]
            blk = torch.stack((bk.index_select(0, rows), bv.index_select(0, rows)))  # [2, G*k, kvh, d]
            buf[:, :, :, l_max:] = blk.view(2, G, k, kvh, d).transpose(2, 3)
            qg = qs.index_select(0, rows).view(G, k, kvh, g, d).transpose(1, 2).reshape(G * kvh, k * g, d)
            keys = buf[0].view(G * kvh, l_max + k, d)
            vals = buf[1].view(G * kvh, l_max + k, d)
            probs = torch.softmax(torch.baddbmm(mask, qg, keys.transpose(1, 2)), dim=-1)
            og = torch.bmm(probs, vals).view(G, kvh, k, g, d).transpose(1, 2).reshape(G * k, -1)
            out.index_copy_(0, rows, og)
        return out
