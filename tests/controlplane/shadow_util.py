"""Helpers of the shadow-evaluation and rollout tests: greedy text, records, a trained drafter."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import torch

from adaflash.contracts.feedback import FeedbackRecord, Sampling, Stats, TargetRef, is_evaluation_record
from controlplane.shadow import target_pass


def evaluation_ids(n: int, start: int = 0, held_out: bool = True) -> list[str]:
    """Record ids that the held-out rule reserves for evaluation (or, held_out=False, for training)."""
    ids = (f"rec-{i:06d}" for i in itertools.count(start))
    return list(itertools.islice((r for r in ids if is_evaluation_record(r) == held_out), n))


@torch.inference_mode()
def greedy(target, prompt: list[int], n: int) -> list[int]:
    kv = target.new_cache(capacity=len(prompt) + n + 1)
    out = target.forward_packed(torch.tensor(prompt), [0, len(prompt)], [kv],
                                logits_index=torch.tensor([len(prompt) - 1]))
    toks = []
    for _ in range(n):
        t = int(out.logits[-1].argmax())
        toks.append(t)
        out = target.forward_packed(torch.tensor([t]), [0, 1], [kv])
    return toks


def record(record_id: str, prompt: str, response: str, *, tenant="acme", domain: str | None = "chat",
           temperature: float = 0.0, target_id: str = "tiny-llama", age: timedelta = timedelta(hours=1),
           now: datetime | None = None) -> FeedbackRecord:
    now = now or datetime.now(UTC)
    return FeedbackRecord(record_id=record_id, tenant_id=tenant, node_id="node-x", request_id=f"req-{record_id}",
                          created_at=now - age, target_model=TargetRef(id=target_id, sha256="0" * 64),
                          drafter_version="1", mode="adaptive",
                          sampling=Sampling(temperature=temperature, top_p=1.0), domain=domain,
                          prompt_text=prompt, response_text=response,
                          stats=Stats(tau_mean=1.0, verify_tokens=1, draft_ms=0.0, verify_ms=0.0))


def train_drafter(drafter, target, sequences: list[list[int]], steps: int = 120, lr: float = 3e-3, seed: int = 0):
    """Fit ``drafter`` to ``sequences`` (teacher-forced blocks): a candidate that really accepts more."""
    torch.manual_seed(seed)
    layers = list(drafter.config.target_layers)
    data = []
    for ids in sequences:
        hidden, _ = target_pass(target, ids, layers, None)
        data.append((hidden.clone(), torch.tensor(ids)))
    k = drafter.config.block_size
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    drafter.train()
    for step in range(steps):
        hidden, toks = data[step % len(data)]
        L = toks.numel()
        anchors = torch.arange(1, L - 1)
        h = drafter.forward_train(hidden, toks, anchors)
        logits = drafter.logits(h[:, 1:])  # [A, k-1, V]
        tgt_idx = anchors.unsqueeze(1) + torch.arange(1, k)
        valid = tgt_idx < L
        tgt = toks[tgt_idx.clamp(max=L - 1)]
        loss = torch.nn.functional.cross_entropy(logits[valid], tgt[valid])
        # The length head learns the accepted share its block would get.
        with torch.no_grad():
            match = (logits.argmax(-1) == tgt) & valid
            share = torch.cumprod(match.long(), 1).sum(1).float() / valid.sum(1).clamp(min=1)
        a_hat = drafter.length_head(h.detach())
        loss = loss + torch.nn.functional.binary_cross_entropy(a_hat, share)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval().requires_grad_(False)
    return drafter
