"""DFlash-style block-diffusion drafter and the AdaFlash length head.

One drafter forward fills a whole block of k positions in parallel: position 0 holds
the last committed token, positions 1..k-1 a learned mask embedding. Context comes from
the target: hidden states of a few target layers are concatenated, projected (Linear +
RMSNorm) and injected as extra keys/values in every drafter layer; the block attends to
all context positions and to itself (non-causal). Token embedding and LM head are the
target's, frozen and not part of the drafter's weights. An optional reduced output
vocabulary (the most frequent tokens) cuts the LM-head cost of drafting.

The length head reads the drafter's final hidden states h [k, H]: per-position
Linear + SiLU to H', mean-pool over positions, Linear + sigmoid -> a_hat, the predicted
share of the block the target will accept.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dataplane.kernels.cpu_linear import PackedLinear, pack_linears
from dataplane.kv_cache import SeqKV
from dataplane.layers import MLP, RMSNorm, Rotary, apply_rotary
from dataplane.model import ModelArgs, TargetModel, default_hidden_layers
from dataplane.packed_attention import BlockPlan


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    target_layers: list[int]
    num_layers: int = 2
    block_size: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0  # 0: full target vocabulary; else size of the reduced output vocab
    head_hidden: int = 128  # H' of the length head
    # The newest context feature (the target's state at the position before the block) also
    # enters every block position's input through ``recent_proj``: the block's own path to
    # what the target computed last, beside attending to it among all context positions.
    recent_input: bool = False

    @classmethod
    def for_target(cls, a: ModelArgs, num_layers: int = 2, n_target_layers: int = 4, block_size: int = 16,
                   draft_vocab_size: int = 0, head_hidden: int = 128, recent_input: bool = False) -> DrafterConfig:
        return cls(
            hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
            target_layers=list(default_hidden_layers(a.num_layers, n_target_layers)),
            num_layers=num_layers, block_size=block_size, rms_norm_eps=a.rms_norm_eps,
            rope_theta=a.rope_theta, draft_vocab_size=draft_vocab_size, head_hidden=head_hidden,
            recent_input=recent_input,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, H] -> k, v [N, kv_heads, d] (rotary on k)."""
        N = x.shape[0]
        k = self.k_proj(x).view(N, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(N, self.kv_heads, self.head_dim)
        return apply_rotary(k, cos, sin), v

    def q(self, x, cos, sin):
        return apply_rotary(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim), cos, sin)


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LengthHead(nn.Module):
    """h [B, k, H] -> a_hat [B] in (0, 1)."""

    def __init__(self, hidden: int, head_hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, head_hidden)
        self.out = nn.Linear(head_hidden, 1)

    def logit(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, k, H] -> the pre-sigmoid value [B] (a_hat = sigmoid(logit))."""
        return self.out(F.silu(self.proj(h)).mean(dim=-2)).squeeze(-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h))


class Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        n_in = len(c.target_layers) * c.hidden_size
        self.fc = nn.Linear(n_in, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        # zero at first: a drafter given the path starts out computing what it did without it
        self.recent_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False) if c.recent_input else None
        if self.recent_proj is not None:
            nn.init.zeros_(self.recent_proj.weight)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.length_head = LengthHead(c.hidden_size, c.head_hidden)
        vmap = torch.arange(c.draft_vocab_size, dtype=torch.int64) if c.draft_vocab_size else torch.empty(0, dtype=torch.int64)
        self.register_buffer("vocab_map", vmap)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        # The target's frozen embedding and LM head, bound by ``bind``; not drafter weights.
        self._shared: dict[str, torch.Tensor] = {}
        nn.init.normal_(self.mask_embedding, std=0.02)

    # --- shared target pieces --------------------------------------------------------------
    def bind(self, target: TargetModel) -> Drafter:
        a = target.args
        c = self.config
        if (a.hidden_size, a.vocab_size) != (c.hidden_size, c.vocab_size):
            raise ValueError(f"drafter (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit the target "
                             f"(hidden {a.hidden_size}, vocab {a.vocab_size})")
        if max(c.target_layers) >= a.num_layers:
            raise ValueError(f"drafter reads target layer {max(c.target_layers)} but the target has {a.num_layers}")
        self._shared = {"embed": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight,
                        "final_norm": target.model.norm.weight}
        self._refresh_head()
        return self

    def _refresh_head(self) -> None:
        w = self._shared["lm_head"]
        self._shared["out_weight"] = w[self.vocab_map] if self.vocab_map.numel() else w
        self._shared.pop("out_packed", None)

    def prepare_serving(self) -> Drafter:
        """Ready for serving: bfloat16 products laid out once for oneDNN, float32 ones through
        the AVX2 kernel where it pays (see kernels.cpu_linear; training still works)."""
        pack_linears(self)
        if self._shared:
            out = PackedLinear(self._shared["out_weight"].detach())
            if out.packed is not None or out.gemv_f32:
                self._shared["out_packed"] = out
        return self

    def set_vocab_map(self, token_ids: torch.Tensor) -> None:
        """Restrict drafting to ``token_ids`` [Vd] (e.g. the most frequent tokens)."""
        self.vocab_map = token_ids.to(torch.int64).to(self.fc.weight.device)
        self.config.draft_vocab_size = int(token_ids.numel())
        if self._shared:
            self._refresh_head()

    def init_from_target(self, target: TargetModel, layers: list[int] | None = None) -> None:
        """Copy attention/MLP/norm weights of target layers (default: the last ones) into the drafter."""
        n = len(self.layers)
        layers = layers or list(range(target.args.num_layers - n, target.args.num_layers))
        for mine, src in zip(self.layers, layers, strict=True):
            t = target.model.layers[src]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(mine.self_attn, name).weight.data.copy_(getattr(t.self_attn, name).weight.data)
            mine.mlp.load_state_dict(t.mlp.state_dict())
            mine.input_layernorm.weight.data.copy_(t.input_layernorm.weight.data)
            mine.post_attention_layernorm.weight.data.copy_(t.post_attention_layernorm.weight.data)
        self.norm.weight.data.copy_(target.model.norm.weight.data)

    # --- pieces of the forward -----------------------------------------------------------
    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden [N, n_target_layers, H] -> projected context features [N, H]."""
        return self.hidden_norm(self.fc(target_hidden.flatten(-2)))

    def block_embeddings(self, last_tokens: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        """last_tokens [B] -> block inputs [B, k, H]: the token at 0, the mask embedding after it;
        with ``recent_input``, plus ``recent_proj`` of recent [B, H] (each block's newest context
        feature) at every position."""
        k = self.config.block_size
        first = F.embedding(last_tokens, self._shared["embed"]).unsqueeze(1)
        rest = self.mask_embedding.to(first.dtype).expand(last_tokens.shape[0], k - 1, -1)
        x = torch.cat([first, rest], dim=1)
        if self.recent_proj is not None and recent is not None:
            x = x + self.recent_proj(recent.to(x.dtype)).unsqueeze(1)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden h [..., H] -> draft logits [..., Vd] (Vd = V or the reduced vocabulary)."""
        packed = self._shared.get("out_packed")
        if packed is not None:
            return packed(self.norm(h))
        return F.linear(self.norm(h), self._shared["out_weight"])

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids."""
        return self.vocab_map[idx] if self.vocab_map.numel() else idx

    def expand_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Draft probabilities [..., Vd] -> [..., V] with zeros outside the draft vocabulary."""
        if not self.vocab_map.numel():
            return q
        full = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        full[..., self.vocab_map] = q
        return full

    # --- inference: per-request context caches --------------------------------------------
    def new_cache(self, capacity: int = 64) -> SeqKV:
        c = self.config
        return SeqKV(c.num_layers, c.num_kv_heads, c.head_dim, self.fc.weight.dtype, self.fc.weight.device,
                     capacity)

    @torch.inference_mode()
    def extend_context(self, target_hidden: torch.Tensor, cu_seqlens: list[int], kvs: list[SeqKV]) -> None:
        """Append committed positions to each request's context cache.

        target_hidden [T, n_target_layers, H]: rows cu_seqlens[b]:cu_seqlens[b+1] belong to
        request b and continue its context at positions kvs[b].length + i.
        """
        if target_hidden.shape[0] == 0:
            return
        feats = self.context_features(target_hidden)
        pos = torch.cat([torch.arange(kv.length, kv.length + int(cu_seqlens[b + 1]) - int(cu_seqlens[b]))
                         for b, kv in enumerate(kvs)]).to(feats.device)
        cos, sin = self.rotary.cos_sin(pos)
        for li, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(feats, cos, sin)
            for b, kv in enumerate(kvs):
                s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
                if e > s:
                    kv.reserve(kv.length + (e - s))
                    kv.write(li, kv.length, k[s:e], v[s:e])
        for b, kv in enumerate(kvs):
            kv.length += int(cu_seqlens[b + 1]) - int(cu_seqlens[b])
            if cu_seqlens[b + 1] > cu_seqlens[b]:
                kv.recent = feats[int(cu_seqlens[b + 1]) - 1].clone()

    @torch.inference_mode()
    def forward_block(self, last_tokens: torch.Tensor, kvs: list[SeqKV]) -> torch.Tensor:
        """One drafter pass for B requests: last_tokens [B] -> final hidden states [B, k, H].

        The block of request b sits at positions kvs[b].length .. +k-1 and attends to all of
        its context and to the whole block (non-causal).
        """
        B, k = last_tokens.shape[0], self.config.block_size
        recent = None
        if self.recent_proj is not None:
            zero = self.fc.weight.new_zeros(self.config.hidden_size)
            recent = torch.stack([zero if kv.recent is None else kv.recent for kv in kvs])
        x = self.block_embeddings(last_tokens.to(self.fc.weight.device), recent).reshape(B * k, -1)
        offs = torch.arange(k)
        pos = torch.cat([kv.length + offs for kv in kvs]).to(x.device)
        cos, sin = self.rotary.cos_sin(pos)
        c = self.config
        plan = BlockPlan([kv.length for kv in kvs], k, c.num_heads, c.num_kv_heads, c.head_dim, x.dtype, x.device)
        for li, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            att = layer.self_attn
            q = att.q(h, cos, sin)
            bk, bv = att.kv(h, cos, sin)
            x = x + att.o_proj(plan.attend(li, q, bk, bv, kvs))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x.view(B, k, -1)

    # --- training: many blocks of one sequence in one pass ----------------------------------
    def forward_train(self, target_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Differentiable forward for blocks anchored inside one sequence.

        target_hidden [L, n_target_layers, H]: the target's hidden states of the sequence;
        tokens [L] int64; anchors [A] int64 with 1 <= anchor <= L-1. Block a holds
        tokens[anchor] at position anchor and masks after it; it attends to the context
        positions < anchor and to its own block. Returns final hidden states [A, k, H];
        position i of block a predicts tokens[anchor + i].
        """
        k = self.config.block_size
        A = anchors.shape[0]
        dev = target_hidden.device
        feats = self.context_features(target_hidden)  # [L, H]
        L = feats.shape[0]
        ctx_cos, ctx_sin = self.rotary.cos_sin(torch.arange(L, device=dev))
        bpos = (anchors.unsqueeze(1) + torch.arange(k, device=dev)).reshape(-1)
        b_cos, b_sin = self.rotary.cos_sin(bpos)
        x = self.block_embeddings(tokens[anchors], feats[anchors - 1]).reshape(A * k, -1)
        # mask [A*k, L + A*k]: context keys before the anchor, and the block's own keys.
        ctx_ok = torch.arange(L, device=dev).unsqueeze(0) < anchors.unsqueeze(1)  # [A, L]
        ctx_ok = ctx_ok.repeat_interleave(k, dim=0)
        blk = torch.arange(A, device=dev).repeat_interleave(k)
        blk_ok = blk.unsqueeze(1) == blk.unsqueeze(0)
        mask = torch.cat([ctx_ok, blk_ok], dim=1)
        for layer in self.layers:
            att = layer.self_attn
            ck, cv = att.kv(feats, ctx_cos, ctx_sin)
            h = layer.input_layernorm(x)
            q = att.q(h, b_cos, b_sin)
            bk, bv = att.kv(h, b_cos, b_sin)
            keys = torch.cat([ck, bk]).transpose(0, 1).unsqueeze(0)  # [1, kvh, L+A*k, d]
            vals = torch.cat([cv, bv]).transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, attn_mask=mask,
                                                 enable_gqa=att.heads != att.kv_heads)
            x = x + att.o_proj(out[0].transpose(0, 1).reshape(A * k, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x.view(A, k, -1)


def new_drafter(target: TargetModel, seed: int = 0, **kwargs) -> Drafter:
    """A randomly initialised drafter bound to ``target`` (kwargs: DrafterConfig.for_target's)."""
    cfg = DrafterConfig.for_target(target.args, **kwargs)
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        d = Drafter(cfg)
        for m in d.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
    d.to(dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device)
    d.rotary.inv_freq = d.rotary.inv_freq.float()
    return d.bind(target)  # trainable: not packed for serving (Drafter.prepare_serving)
