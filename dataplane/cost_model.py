"""The node's measured cost of a step, and the break-even rule built on it.

Step time is modelled as ``base + per_request * B + per_token * T`` for a verify pass of
T tokens over B requests, fitted online by least squares on recent steps, plus the
drafter's time per drafted request. Speculating for one request pays only if the tokens
it is expected to gain outweigh the extra verify and draft time it adds:

    gain = E[tokens | m] / (1 + extra / ar_share)

where ``extra`` is the time its m - 1 drafts and its drafter share add, and ``ar_share``
its share of a plain one-token step.

``best_length`` picks the verified length itself. Acceptance inside a block is modelled
as geometric with per-position probability p (a draft is kept only if every earlier one
was, and later positions are kept less often, as PAPER.md measures), p chosen so that
the expected number of accepted drafts out of k - 1 equals the head's a * (k - 1):

    p + p^2 + ... + p^(k-1) = a * (k - 1)
    expected tokens of verifying m = 1 + p + ... + p^(m-1)

and m maximises expected tokens per unit of step time. With a weak drafter (a * (k - 1)
well below 1) the first draft can still pay where a verify token is cheap (few requests),
which the paper's floor(gamma * a * k) rule, made for strong drafters, rounds to 1.
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
        if len(self.obs) >= 8 and len(self.obs) % 4 == 0:
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

    @staticmethod
    def position_accept(accept_ratio: float, k: int) -> float:
        """Per-position acceptance p whose expected accepted drafts out of k - 1 equal
        accept_ratio * (k - 1) (bisection on the truncated geometric mean), at most 0.995."""
        n = k - 1
        target = min(max(accept_ratio, 0.0), 1.0) * n
        if target <= 0.0 or n <= 0:
            return 0.0
        lo, hi = 0.0, 0.995
        if CostModel.expected_accepted(hi, n) <= target:
            return hi
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if CostModel.expected_accepted(mid, n) < target:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    @staticmethod
    def expected_accepted(p: float, drafts: int) -> float:
        """Expected accepted drafts out of ``drafts`` under per-position acceptance p:
        p + p^2 + ... + p^drafts."""
        if p >= 1.0:
            return float(drafts)
        return p * (1.0 - p ** drafts) / (1.0 - p)

    def best_length(self, p: float, cap: int, batch: int) -> tuple[int, float]:
        """(m, gain) maximising expected tokens per step time over m in 1..cap, for
        per-position acceptance p.

        gain counts the drafter's share, so a gain below 1 means drafting for this request
        did not pay even at the best length (the caller backs off); m ignores it, because
        by the time m is chosen the drafter has already run.
        """
        base, per_req, per_tok = self.coef
        ar_share = base / max(batch, 1) + per_req + per_tok
        best_m, best_rate, tokens = 1, 1.0, 1.0
        for m in range(2, cap + 1):
            tokens += p ** (m - 1)
            rate = tokens / (1.0 + per_tok * (m - 1) / ar_share)
            if rate > best_rate:
                best_m, best_rate = m, rate
        exp_tokens = 1.0 + self.expected_accepted(p, best_m - 1)
        gain = exp_tokens / (1.0 + (per_tok * (best_m - 1) + self.draft_per_request_s) / ar_share)
        return best_m, gain

    def snapshot(self) -> dict:
        base, per_req, per_tok = self.coef
        return {"base_s": base, "per_request_s": per_req, "per_token_s": per_tok,
                "draft_per_request_s": self.draft_per_request_s, "observations": len(self.obs)}
