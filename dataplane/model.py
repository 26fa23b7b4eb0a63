"""The frozen target: a Llama / Qwen3-family decoder with a packed variable-length forward.

One call runs a flat stream of tokens from many requests. Each request's new tokens
attend to that request's cached prefix and causally among themselves; the call returns
logits at the positions asked for and the hidden states of chosen layers (what the
drafter is conditioned on). Weights load from a Hugging Face directory (config.json +
model.safetensors) with the same parameter names.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from dataplane.attention import attend
from dataplane.fused_layers import FusedModel, fused_key
from dataplane.kernels.cpu_elementwise import rms_norm
from dataplane.kv_cache import SeqKV
from dataplane.layers import MLP, RMSNorm, Rotary, apply_rotary, chunked_linear
from dataplane.packed_attention import StreamPlan

# Batch-invariant numerics (DataplaneConfig.batch_invariant): every matrix product over the
# token stream has exactly this many rows (see layers.chunked_linear); a forward whose
# requests all start from an empty cache (a prefill) uses the larger size.
BI_DECODE_ROWS = 8
BI_PREFILL_ROWS = 64


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = False  # Qwen3
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelArgs:
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen3", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}")
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int = 0):
        """x [T, H] -> q [T, heads, d], k, v [T, kv_heads, d] with rotary applied."""
        T = x.shape[0]
        if rows:
            q, k, v = (chunked_linear(p, x, rows) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.heads, self.head_dim)
        k = k.view(T, self.kv_heads, self.head_dim)
        v = v.view(T, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, layer: int, kvs: list[SeqKV], bounds: list[tuple[int, int, int]],
                rows: int = 0, plan: StreamPlan | None = None):
        """x [T, H]; bounds: per request (stream start, stream end, cache start).

        rows = 0 (default numerics): attention as ``plan`` lays it out (requests of a few
        tokens batched, see dataplane.packed_attention).

        rows > 0: batch-invariant numerics. Products of ``rows`` rows, and each new token of
        a request that continues a cache attends on its own, to exactly the keys it sees:
        attention with a causal mask rounds a query differently with the number of masked
        keys after it, i.e. with how many tokens its request brought in this step. Tokens
        of a request starting from an empty cache (a prompt) attend together.
        """
        q, k, v = self.qkv(x, cos, sin, rows)
        if not rows:
            return self.o_proj(plan.attend(layer, q, k, v, kvs))
        out = torch.zeros_like(q)
        for b, (s, e, start) in enumerate(bounds):
            kv = kvs[b]
            kv.write(layer, start, k[s:e], v[s:e])
            if start > 0:
                for i in range(e - s):
                    kc, vc = kv.view(layer, start + i + 1)
                    out[s + i : s + i + 1] = attend(q[s + i : s + i + 1].to(kc.dtype), kc, vc, causal=True)
                continue
            kc, vc = kv.view(layer, start + (e - s))
            out[s:e] = attend(q[s:e].to(kc.dtype), kc, vc, causal=True)
        return chunked_linear(self.o_proj, out.reshape(x.shape[0], -1), rows)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, layer, kvs, bounds, rows: int = 0, plan: StreamPlan | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, kvs, bounds, rows, plan)
        return x + self.mlp(self.post_attention_layernorm(x), rows)


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs, init: bool = True):
        super().__init__()
        # init=False: weights are about to be loaded. Skipping the embedding's random fill
        # matters under a meta device, where it would import torch._dynamo (seconds at start).
        self.embed_tokens = (nn.Embedding(a.vocab_size, a.hidden_size) if init else
                             nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size)))
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [M, V] at logits_index
    hidden: torch.Tensor | None  # [T, len(hidden_layers), H]


class TargetModel(nn.Module):
    """Decoder-only LM. ``forward_packed`` is the only entry point the engine needs."""

    def __init__(self, a: ModelArgs, init: bool = True):
        super().__init__()
        self.args = a
        self.model = Backbone(a, init)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # built by from_pretrained outside its meta device (tables there would import torch._dynamo)
        self.rotary = Rotary(a.head_dim, a.rope_theta) if init else None
        # Batch-invariant numerics (see forward_packed); the engine sets it from
        # DataplaneConfig.batch_invariant.
        self.batch_invariant = False
        self._fused: FusedModel | None = None
        # The module-by-module forward (tests compare the fused serving forward with it).
        self.reference = False
        # (rows, seconds) of the weight products alone, measured by ``warm_up`` (CostModel.set_products).
        self.product_curve: list[tuple[int, float]] = []

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> TargetModel:
        d = Path(directory)
        args = ModelArgs.from_hf(json.loads((d / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(args, init=False)
        state = {}
        for f in sorted(d.glob("*.safetensors")):
            state.update(load_file(str(f), device=str(device)))
        if args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = Rotary(args.head_dim, args.rope_theta)
        model.to(device=device, dtype=dtype)
        model.rotary.inv_freq = model.rotary.inv_freq.float()
        model.eval().requires_grad_(False)
        model.batch_invariant = False
        model._fused = None
        model.reference = False
        model.product_curve = []
        return model

    def fused(self) -> FusedModel:
        """The serving forward's fused weights, built on first use and after the weights change."""
        if self._fused is None or self._fused.key != fused_key(self):
            self._fused = FusedModel(self)
        return self._fused

    @property
    def kv_dtype(self) -> torch.dtype:
        """Keys and values are kept in float32 on CPU whatever the weights' precision: the
        few-query attention products of a decode or verify step run 2-6x faster in float32
        there than in bfloat16, and a float32 cache is exact for bfloat16 keys."""
        p = self.lm_head.weight
        return torch.float32 if p.device.type == "cpu" else p.dtype

    def new_cache(self, capacity: int = 64) -> SeqKV:
        a = self.args
        p = self.lm_head.weight
        return SeqKV(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype, p.device, capacity)

    def warm_up(self) -> float:
        """A prompt, a decode of two requests and a verify through the serving forward, on
        scratch caches: its kernels are built or loaded and its weights laid out now, so a
        node's first request does not pay for them. Returns the seconds it took."""
        t0 = time.perf_counter()
        kvs = [self.new_cache(16), self.new_cache(16)]
        ids = torch.arange(1, 9, dtype=torch.int64) % self.args.vocab_size
        self.forward_packed(ids[:5], [0, 5], kvs[:1])  # a prompt
        self.forward_packed(ids[:2], [0, 1, 2], kvs)  # a decode step of two requests
        self.forward_packed(ids[:4], [0, 4], kvs[:1])  # a verify
        self.product_curve = self.product_times()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def product_times(self, rows=(1, 8, 16, 32, 64, 128, 256), repeats: int = 2) -> list[tuple[int, float]]:
        """(rows, seconds): every weight product of one serving forward (each layer's fused
        matrices and the output head) on ``rows`` rows of random input, the fastest of
        ``repeats``: what the rows of extra verified tokens cost at least."""
        f = self.fused()
        mats = [m for layer in f.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [f.lm_head]
        w = self.lm_head.weight
        g = torch.Generator().manual_seed(0)
        out = []
        for r in rows:
            xs = {k: torch.randn(r, k, generator=g).to(dtype=w.dtype, device=w.device)
                  for k in {m.weight.shape[1] for m in mats}}
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for m in mats:
                    m(xs[m.weight.shape[1]])
                if w.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out.append((r, best))
        return out

    # --- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_packed(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: list[int],
        kvs: list[SeqKV],
        logits_index: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run a packed stream.

        input_ids [T] int64: request b's new tokens are input_ids[cu_seqlens[b]:cu_seqlens[b+1]];
        they continue request b's cache ``kvs[b]`` (positions kvs[b].length + i), and after the
        call each cache's length includes them (truncate to drop rejected ones).
        logits_index [M] int64: stream rows whose next-token logits to return (None: all rows).
        hidden_layers: decoder layer indices (0-based) whose outputs to return.
        Returns logits [M, V] and hidden [T, len(hidden_layers), H].

        With ``batch_invariant`` set, a token's logits and hidden states are bitwise the same
        whatever else the stream holds: the other requests, and, for a request continuing
        its cache, how many new tokens it brought (1 in plain decoding, k+1 when verifying).
        A prompt's tokens (a request starting from an empty cache) are computed together,
        so they depend on the prompt only. Greedy ar, fixed and adaptive then emit the same
        tokens exactly. Off, rows round differently with the stream's shape (near-ties may flip).
        """
        return self._forward(input_ids, cu_seqlens, kvs, logits_index, hidden_layers)

    def _forward(self, input_ids, cu_seqlens, kvs, logits_index, hidden_layers) -> ForwardOutput:
        device = self.lm_head.weight.device  # the engine builds its index tensors on the host
        input_ids = input_ids.to(device)
        if logits_index is not None:
            logits_index = logits_index.to(device)
        bounds, positions = [], []
        for b, kv in enumerate(kvs):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            start = kv.length
            kv.reserve(start + (e - s))
            bounds.append((s, e, start))
            positions.append(torch.arange(start, start + (e - s)))
        pos = torch.cat(positions).to(input_ids.device)
        T = input_ids.shape[0]
        rows = 0
        if self.batch_invariant:
            rows = BI_PREFILL_ROWS if all(start == 0 for _, _, start in bounds) else BI_DECODE_ROWS
            pad = (-T) % rows  # zero rows so every product has ``rows`` rows; attention skips them
            if pad:
                input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
                pos = torch.cat([pos, pos.new_zeros(pad)])
        cos, sin = self.rotary.cos_sin(pos)
        x = self.model.embed_tokens(input_ids)
        want: dict[int, list[int]] = {}
        for slot, layer in enumerate(hidden_layers):
            want.setdefault(layer, []).append(slot)
        hidden = (torch.empty(T, len(hidden_layers), x.shape[1], dtype=x.dtype, device=x.device)
                  if hidden_layers else None)
        a = self.args
        if rows or self.reference:
            plan = None if rows else StreamPlan(bounds, a.num_heads, a.num_kv_heads, a.head_dim, self.kv_dtype,
                                                x.device)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, i, kvs, bounds, rows, plan)
                for slot in want.get(i, ()):
                    hidden[:, slot] = x[:T]
        else:
            x = self._fused_layers(x, cos, sin, kvs, bounds, want, hidden)
        for (s, e, start), kv in zip(bounds, kvs, strict=True):
            kv.length = start + (e - s)
        logits = None
        if logits_index is None or logits_index.numel():
            h = x[:T] if logits_index is None else x[logits_index]
            norm = self.model.norm
            h = norm(h) if rows or self.reference else rms_norm(h, norm.weight, norm.eps)
            # Few rows want logits (one per request in a prefill): the small size suffices.
            if rows:
                logits = chunked_linear(self.lm_head, h, BI_DECODE_ROWS)
            else:
                logits = self.lm_head(h) if self.reference else self.fused().lm_head(h)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _fused_layers(self, x, cos, sin, kvs, bounds, want, hidden) -> torch.Tensor:
        """Default numerics: every layer through ``dataplane.fused_layers`` (same math, fewer
        calls); in float32 on CPU, all of them in one C call where that serves (``kernels.cpu_forward``)."""
        a, T = self.args, x.shape[0]
        fused = self.fused()
        caches = [kv.data for kv in kvs]
        if fused.stack is not None and fused.stack.takes(x, bounds, caches):  # every layer in one C call
            slot_layers = [0] * (hidden.shape[1] if hidden is not None else 0)
            for layer, slots in want.items():
                for s in slots:
                    slot_layers[s] = layer
            return fused.stack.run(x, cos.to(x.dtype), sin.to(x.dtype), caches, bounds, tuple(slot_layers), hidden)[0]
        plan = StreamPlan(bounds, a.num_heads, a.num_kv_heads, a.head_dim, self.kv_dtype, x.device, fast=True)
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [T, 1, d]
        for i, layer in enumerate(fused.layers):
            x = layer.forward(x, cos, sin, lambda q, k, v, i=i: plan.attend(i, q, k, v, kvs))
            for slot in want.get(i, ()):
                hidden[:, slot] = x[:T]
        return x


def default_hidden_layers(num_layers: int, n: int) -> tuple[int, ...]:
    """n target layers evenly spaced from 1 to L-3 (PAPER.md), e.g. L=30, n=4 -> (1, 10, 18, 27)."""
    if n == 1:
        return (num_layers // 2,)
    lo, hi = 1, num_layers - 3
    if hi - lo + 1 < n:  # small models: spread over every layer instead
        lo, hi = 0, num_layers - 1
    return tuple(sorted({int(round(lo + (hi - lo) * i / (n - 1))) for i in range(n)}))
