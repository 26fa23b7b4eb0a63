"""A test drafter that drafts the target's own greedy continuation, with controlled errors.

It lets engine tests exercise every acceptance length (all accepted, first rejected,
partial) on a tiny random model, where a learned drafter would accept almost nothing.
"""

from __future__ import annotations

import torch

from dataplane.drafter import Drafter


class OracleDrafter(Drafter):
    def __init__(self, base: Drafter, target, error_rate: float = 0.3, a_hat: float = 0.6, seed: int = 0):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.bind(target)
        self.target = target
        self.error_rate = error_rate
        self.fixed_a_hat = a_hat
        self.history: dict[int, list[int]] = {}  # id(drafter kv) -> committed tokens
        self.g = torch.Generator().manual_seed(seed)
        self._pending: list[list[int]] = []

    def track(self, kv, tokens: list[int]) -> None:
        self.history[id(kv)] = tokens

    @torch.inference_mode()
    def forward_block(self, last_tokens, kvs):
        k = self.config.block_size
        self._pending = []
        for kv in kvs:
            toks = list(self.history[id(kv)]())
            kv_t = self.target.new_cache()
            out = self.target.forward_packed(torch.tensor(toks), [0, len(toks)], [kv_t],
                                             logits_index=torch.tensor([len(toks) - 1]))
            drafts = []
            nxt = int(out.logits[0].argmax())
            for _ in range(k - 1):
                if float(torch.rand(1, generator=self.g)) < self.error_rate:
                    nxt = (nxt + 1) % self.config.vocab_size
                drafts.append(nxt)
                out = self.target.forward_packed(torch.tensor([nxt]), [0, 1], [kv_t])
                nxt = int(out.logits[0].argmax())
        # Encode (request, position) in the hidden state so ``logits`` can find the drafts.
            self._pending.append(drafts)
        h = torch.zeros(len(kvs), k, self.config.hidden_size)
        h[:, :, 0] = torch.arange(len(kvs)).unsqueeze(1).float()
        h[:, :, 1] = torch.arange(k).unsqueeze(0).float()
        return h

    def length_head(self, h):
        return torch.full((h.shape[0],), self.fixed_a_hat)

    def logits(self, h):
        out = torch.full((*h.shape[:-1], self.config.vocab_size), -1e4)
        for b in range(h.shape[0]):
            for j in range(h.shape[1]):
                req, pos = int(h[b, j, 0]), int(h[b, j, 1])
                out[b, j, self._pending[req][pos - 1]] = 0.0
        return out
