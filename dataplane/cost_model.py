"""The node's measured cost of a step: step time per (batch, verify tokens).

Step time does not grow linearly with the verify tokens (on a CPU four rows can cost far
more than three), so the node keeps a table of measured step times, one moving average
per (batch, tokens) it has run, and answers ``step_time(batch, tokens)`` by interpolating
it: linearly between the nearest measured token counts of that batch, then between the
nearest measured batches. Outside the measured range the nearest point is extended with
the linear model's slope. The linear model ``base + per_request * B + per_token * T``,
started from priors and refitted by ridge least squares on recent steps, is the fallback
where nothing was measured.

Step times are noisy on a shared machine, and a few steps can make more verify tokens look
cheaper than fewer (at C=32 on a 2-core Zen 4, 40 tokens measured 55 ms against 58 ms for 32,
so drafting looked free where it cost a fifth of the step). The target's weight products
alone, timed per row count when the node starts (``TargetModel.product_times``), bound
that: verifying n tokens over b requests costs at least the time at b tokens plus the
products of the n - b extra rows.

The policy built on this curve (which lengths pay) lives in ``dataplane.spec_policy``;
``snapshot`` / ``from_snapshot`` carry the curve in heartbeats
(``adaflash.contracts.cost_curve.CostCurve``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from adaflash.contracts.cost_curve import MAX_COST_POINTS, CostCurve, CostPoint, ProductPoint

MIN_POINT_COUNT = 2  # a table entry is used once it averaged this many steps (the first is warm-up prone)
POINT_EMA = 0.2  # weight of a new step in its entry, after the first 1/POINT_EMA steps (plain mean before)
DRAFT_EMA = 0.1


def _piecewise(pts: list[tuple[int, float]], x: int, slope: float) -> float:
    """Linear interpolation in sorted (x, seconds) points; outside them the nearest point is
    extended with ``slope`` (never below a microsecond)."""
    i = bisect.bisect_left(pts, (x, -math.inf))
    if i < len(pts) and pts[i][0] == x:
        return pts[i][1]
    if i == 0:
        return max(1e-6, pts[0][1] - slope * (pts[0][0] - x))
    if i == len(pts):
        return pts[-1][1] + slope * (x - pts[-1][0])
    (x0, s0), (x1, s1) = pts[i - 1], pts[i]
    return s0 + (s1 - s0) * (x - x0) / (x1 - x0)


class CostModel:
    def __init__(self, base_s: float = 0.08, per_request_s: float = 0.004, per_token_s: float = 0.0025,
                 draft_per_request_s: float = 0.01, window: int = 256):
        self.prior = np.array([base_s, per_request_s, per_token_s])
        self.coef = self.prior.copy()
        self.draft_per_request_s = draft_per_request_s
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.table: dict[tuple[int, int], tuple[float, int]] = {}  # (batch, tokens) -> (seconds, count)
        self._rows: dict[int, list[tuple[int, float]]] | None = None  # batch -> sorted (tokens, seconds)
        self.products: list[tuple[int, float]] = []  # (rows, seconds) of the weight products alone, rising
        self._plain: dict[int, tuple[float, float]] = {}  # batch -> (plain step, its rows' products), per table

    def set_products(self, points) -> None:
        """The target's weight products timed per row count ((rows, seconds) pairs): the
        least that extra verify rows cost. Made non-decreasing in rows."""
        out: list[tuple[int, float]] = []
        for r, sec in sorted((int(r), float(sec)) for r, sec in points):
            out.append((r, max(sec, out[-1][1]) if out else sec))
        self.products = out
        self._changed()

    def products_time(self, rows: int) -> float:
        """Seconds of the weight products for ``rows`` rows, interpolated in ``products``
        (beyond them, along the last segment's slope)."""
        pts = self.products
        if not pts:
            return 0.0
        slope = (pts[-1][1] - pts[-2][1]) / (pts[-1][0] - pts[-2][0]) if len(pts) > 1 else 0.0
        return _piecewise(pts, rows, slope)

    def _changed(self) -> None:
        """The table, the fit or the products changed: answers cached from them are stale."""
        self._rows = None
        self._plain.clear()

    # -- measuring --
    def observe_verify(self, batch: int, tokens: int, seconds: float) -> None:
        self.obs.append((batch, tokens, seconds))
        key = (batch, tokens)
        old = self.table.get(key)
        if old is None:
            if len(self.table) >= MAX_COST_POINTS:
                return
            self.table[key] = (seconds, 1)
        else:
            s, n = old
            w = max(POINT_EMA, 1.0 / (n + 1))
            self.table[key] = ((1.0 - w) * s + w * seconds, n + 1)
        self._changed()
        if len(self.obs) >= 8 and len(self.obs) % 4 == 0:
            self._fit()

    def observe_draft(self, batch: int, seconds: float) -> None:
        if batch > 0:
            self.draft_per_request_s = (1 - DRAFT_EMA) * self.draft_per_request_s + DRAFT_EMA * seconds / batch

    def set_point(self, batch: int, tokens: int, seconds: float, count: int = MIN_POINT_COUNT) -> None:
        """Put a measured point in the table directly (benchmarks that time steps themselves)."""
        self.table[(batch, tokens)] = (seconds, count)
        self._changed()

    def _fit(self) -> None:
        a = np.array([[1.0, b, t] for b, t, _ in self.obs])
        y = np.array([s for _, _, s in self.obs])
        # Ridge towards the prior keeps the fit sane when the batch mix barely varies.
        lam = 1e-3
        coef = np.linalg.solve(a.T @ a + lam * np.eye(3), a.T @ y + lam * self.prior)
        self.coef = np.maximum(coef, 1e-5)
        self._changed()

    # -- answering --
    @property
    def measured(self) -> bool:
        return bool(self._table_rows())

    def linear_time(self, batch: int, tokens: int) -> float:
        base, per_req, per_tok = self.coef
        return float(base + per_req * batch + per_tok * tokens)

    def _table_rows(self) -> dict[int, list[tuple[int, float]]]:
        if self._rows is None:
            rows: dict[int, list[tuple[int, float]]] = {}
            for (b, t), (s, n) in self.table.items():
                if n >= MIN_POINT_COUNT:
                    rows.setdefault(b, []).append((t, s))
            self._rows = {b: sorted(r) for b, r in rows.items()}
        return self._rows

    def _along_tokens(self, row: list[tuple[int, float]], tokens: int) -> float:
        return _piecewise(row, tokens, float(self.coef[2]))

    def step_time(self, batch: int, tokens: int) -> float:
        """Seconds of one verify pass over ``batch`` requests and ``tokens`` tokens: the measured
        curve, and where tokens > batch never less than the plain step plus the extra rows' products."""
        t = self._measured_time(batch, tokens)
        if self.products and tokens > batch:
            plain = self._plain.get(batch)
            if plain is None:
                plain = self._plain[batch] = (self._measured_time(batch, batch), self.products_time(batch))
            t = max(t, plain[0] + self.products_time(tokens) - plain[1])
        return t

    def _measured_time(self, batch: int, tokens: int) -> float:
        rows = self._table_rows()
        if not rows:
            return self.linear_time(batch, tokens)
        if batch in rows:
            return self._along_tokens(rows[batch], tokens)
        batches = sorted(rows)
        i = bisect.bisect_left(batches, batch)
        per_req = float(self.coef[1])
        if i == 0:
            return max(1e-6, self._along_tokens(rows[batches[0]], tokens) - per_req * (batches[0] - batch))
        if i == len(batches):
            return self._along_tokens(rows[batches[-1]], tokens) + per_req * (batch - batches[-1])
        b0, b1 = batches[i - 1], batches[i]
        s0, s1 = self._along_tokens(rows[b0], tokens), self._along_tokens(rows[b1], tokens)
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    # -- travelling --
    def snapshot(self) -> CostCurve:
        base, per_req, per_tok = (float(x) for x in self.coef)
        pts = sorted(list(self.table.items()), key=lambda kv: -kv[1][1])[:MAX_COST_POINTS]  # copy: engine thread writes
        return CostCurve(base_s=base, per_request_s=per_req, per_token_s=per_tok,
                         draft_per_request_s=float(self.draft_per_request_s),
                         points=[CostPoint(batch=b, tokens=t, seconds=s, count=n)
                                 for (b, t), (s, n) in sorted(pts)],
                         products=[ProductPoint(rows=r, seconds=s) for r, s in self.products],
                         observations=len(self.obs))

    @classmethod
    def from_snapshot(cls, curve: CostCurve | dict) -> CostModel:
        c = curve if isinstance(curve, CostCurve) else CostCurve.model_validate(curve)
        m = cls(base_s=c.base_s, per_request_s=c.per_request_s, per_token_s=c.per_token_s,
                draft_per_request_s=c.draft_per_request_s)
        for p in c.points:
            m.table[(p.batch, p.tokens)] = (p.seconds, p.count)
        m.set_products((p.rows, p.seconds) for p in c.products)
        return m
