"""Initialisation of a DFlash drafter from target-labelled data: its draft vocabulary
(``frequent_vocab``) and a bigram model in its first layer.

A DFlash drafter learns slowly per token (shared/DATA.md), while a plain bigram table
(the target's most frequent next token after the anchor token) already predicts the
first block position of the target's own answers well. This module writes a low-rank
bilinear bigram model into the drafter's first layer, so training starts from it:

- queries zero: every block position attends uniformly over context and block;
- context features zero (the context norm's gain starts at 0, so context keys and values
  are 0 and the gain opens under training) and a mask embedding in the null space of
  the value projection: the only non-zero value is the anchor token's, so every masked
  position receives V x_t (scaled);
- o_proj . v_proj = W V, a rank-(kv_heads * head_dim) least-squares fit mapping the
  anchor token's normalised embedding x_t to the direction whose logits (after the final
  norm and the tied LM head) favour the target's next tokens after t;
- MLP output projection zero, further layers' output projections zero (identity).

Every piece is an ordinary drafter weight and training moves all of them from there.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def bigram_counts(examples, vocab_index: torch.Tensor | None = None) -> Counter:
    """(anchor token, target top-1 after it) pairs over answer positions."""
    c: Counter = Counter()
    for e in examples:
        t = e.tokens[e.resp_start:-1].tolist()
        lab = e.labels[e.resp_start:-1].tolist()
        c.update(zip(t, lab, strict=True))
    return c


@torch.no_grad()
def fit_bigram(drafter, target, pairs: Counter, ridge: float = 1e-2, scale: float = 256.0,
               temperature: float = 0.15) -> dict:
    """Fit and write the bigram init into ``drafter``; returns fit statistics.

    ``temperature`` scales the final norm's gain (the logit scale): the argmax is that of
    the fit, the distribution is soft enough for cross-entropy to refine it."""
    c = drafter.config
    E = target.model.embed_tokens.weight.float()  # [V, H]
    g = target.model.norm.weight.float()
    layer = drafter.layers[0]
    ln_w = layer.input_layernorm.weight.float()
    ctx = sorted({t for t, _ in pairs})
    cidx = {t: i for i, t in enumerate(ctx)}
    n_ctx = len(ctx)
    # target directions: mean over next tokens u (by count) of normalize(g * E[u])
    Z = torch.zeros(n_ctx, c.hidden_size)
    w = torch.zeros(n_ctx)
    dir_u = F.normalize(g * E, dim=-1)
    by_t: dict[int, Counter] = {}
    for (t, u), n in pairs.items():
        by_t.setdefault(t, Counter())[u] = n
    for t, cnt in by_t.items():
        us = torch.tensor(list(cnt.keys()))
        ns = torch.tensor(list(cnt.values()), dtype=torch.float32)
        # weight the most frequent continuation strongly: greedy acceptance needs the argmax
        p = ns.pow(2) / ns.pow(2).sum()
        Z[cidx[t]] = (p.unsqueeze(1) * dir_u[us]).sum(0)
        w[cidx[t]] = ns.sum()
    X = ln_w * _rms(E[torch.tensor(ctx)], c.rms_norm_eps)  # [n_ctx, H]
    sw = w.sqrt().unsqueeze(1)
    Xw, Zw = X * sw, Z * sw
    A = Xw.T @ Xw + ridge * torch.eye(c.hidden_size) * float(w.sum()) / n_ctx
    M = torch.linalg.solve(A, Xw.T @ Zw).T  # [H, H]: z ~ M x
    r = c.num_kv_heads * c.head_dim
    U, S, Vh = torch.linalg.svd(M)
    Wm = U[:, :r] * S[:r]  # [H, r]
    Vm = Vh[:r]  # [r, H]
    # fit quality: greedy accuracy of the rank-r predictor vs the bigram table
    zs = g * _rms(X @ (Wm @ Vm).T, c.rms_norm_eps)
    vocab = drafter.vocab_map if drafter.vocab_map.numel() else torch.arange(c.vocab_size)
    pred = vocab[(zs @ E[vocab].T).argmax(-1)]
    best = torch.tensor([by_t[t].most_common(1)[0][0] for t in ctx])
    table_hits = sum(by_t[t].most_common(1)[0][1] for t in ctx)
    fit_hits = sum(by_t[t][int(p)] for t, p in zip(ctx, pred.tolist(), strict=True))
    total = sum(pairs.values())
    # write the weights
    att = layer.self_attn
    dt = att.q_proj.weight.dtype
    att.q_proj.weight.zero_()
    att.v_proj.weight.copy_(Vm.to(dt))
    per_group = c.num_heads // c.num_kv_heads
    o = torch.zeros(c.hidden_size, c.num_heads * c.head_dim)
    for h in range(c.num_heads):
        grp = h // per_group
        o[:, h * c.head_dim:(h + 1) * c.head_dim] = Wm[:, grp * c.head_dim:(grp + 1) * c.head_dim] * scale / per_group
    att.o_proj.weight.copy_(o.to(dt))
    layer.mlp.down_proj.weight.zero_()
    for extra in drafter.layers[1:]:
        extra.self_attn.o_proj.weight.zero_()
        extra.mlp.down_proj.weight.zero_()
    drafter.hidden_norm.weight.zero_()
    # mask embedding m with v_proj(ln(m)) = 0: m = n / ln_w for n in the null space of V
    _, _, vh_full = torch.linalg.svd(Vm, full_matrices=True)
    n = vh_full[r:].T @ torch.randn(c.hidden_size - r, generator=torch.Generator().manual_seed(0))
    m = n / torch.where(ln_w.abs() > 1e-3, ln_w, torch.full_like(ln_w, 1e-3))
    drafter.mask_embedding.copy_((m * 1e-3 / m.pow(2).mean().sqrt()).to(dt))
    drafter.norm.weight.copy_((g * temperature).to(dt))
    del best
    return {"pairs": total, "contexts": n_ctx, "table_acc": table_hits / max(total, 1),
            "fit_acc": fit_hits / max(total, 1), "rank": r}


def text_token_counts(tok, n_per_domain: int = 1500) -> Counter:
    """Token frequencies of training reference texts (tokenizer only, no target): a prior
    for the draft vocabulary while few target-labelled shards exist."""
    import promptsets as ds

    c: Counter = Counter()
    for dom in ds.DOMAINS:
        for r in ds.train_texts(dom, n_per_domain):
            c.update(tok.encode(r["response"]))
    return c


def frequent_vocab(pool, size: int, always: list[int], vocab_size: int, prior: Counter | None = None
                   ) -> torch.Tensor:
    """The ``size`` most frequent target top-1 labels in the answers (plus ``always``); label
    counts weigh 4x, ``prior`` (reference-text token counts) 1x."""
    size = min(size, vocab_size)
    counts: Counter = Counter()
    for t, n in pool.label_counts().items():
        counts[t] += 4 * n
    for t, n in (prior or {}).items():
        if t < vocab_size:
            counts[t] += n
    ids = list(dict.fromkeys([*always, *[t for t, _ in counts.most_common(size)]]))[:size]
    if len(ids) < size:  # little data: pad with the lowest unused ids so the size is what was asked
        have = set(ids)
        ids += [t for t in range(vocab_size) if t not in have][: size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.int64)
