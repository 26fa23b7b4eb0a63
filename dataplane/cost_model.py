"""The node's measured cost of a step, and the break-even rule built on it.

Step time is modelled as ``base + per_request * B + per_token * T`` for a verify pass of
T tokens over B requests, fitted online by least squares on recent steps, plus the
drafter's time per drafted request. Speculating for one request pays only if the tokens
it is expected to gain outweigh the extra verify and draft time it adds:

    gain = (1 + a * (k_hat - 1)) / (1 + extra / ar_share)

where ``a`` is the expected acceptance ratio, ``extra`` the time its k_hat - 1 drafts and
its drafter share add, and ``ar_share`` its share of a plain one-token step.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class CostModel:
    def __init__(self, base_s: float = 0.08, per_request_s: float = 0.004, per_token_s: float = 0.0025,
                 draft_per_request_s: float = 0.01, window: int = 256):
        self.prior = np.array([base_s, per_request_s, per_token_s])
        self.coef = self.prior.copy()
        self.draft_per_request_s = draft_per_request_s
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)

    def observe_verify(self, batch: int, tokens: int, seconds: float) -> None:
        self.obs.append((batch, tokens, seconds))
        if len(self.obs) >= 16 and len(self.obs) % 8 == 0:
            self._fit()

    def observe_draft(self, batch: int, seconds: float) -> None:
        if batch > 0:
            self.draft_per_request_s = 0.9 * self.draft_per_request_s + 0.1 * seconds / batch

    def _fit(self) -> None:
        a = np.array([[1.0, b, t] for b, t, _ in self.obs])
        y = np.array([s for _, _, s in self.obs])
        # Ridge towards the prior keeps the fit sane when the batch mix barely varies.
        lam = 1e-3
        coef = np.linalg.solve(a.T @ a + lam * np.eye(3), a.T @ y + lam * self.prior)
        self.coef = np.maximum(coef, 1e-5)

    def step_time(self, batch: int, tokens: int) -> float:
        base, per_req, per_tok = self.coef
        return float(base + per_req * batch + per_tok * tokens)

    def gain(self, accept_ratio: float, k_hat: int, batch: int) -> float:
        """Expected speed of speculating with k_hat relative to plain decoding, for one request."""
        base, per_req, per_tok = self.coef
        ar_share = base / max(batch, 1) + per_req + per_tok
        extra = per_tok * (k_hat - 1) + self.draft_per_request_s
        return (1.0 + accept_ratio * (k_hat - 1)) / (1.0 + extra / ar_share)

    def snapshot(self) -> dict:
        base, per_req, per_tok = self.coef
        return {"base_s": base, "per_request_s": per_req, "per_token_s": per_tok,
                "draft_per_request_s": self.draft_per_request_s, "observations": len(self.obs)}
