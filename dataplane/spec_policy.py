"""The speculation policy: what each request drafts and verifies, and when it stops drafting.

Pure functions over explicit state (``RequestState`` per request, ``NodeState`` per
node), the node's cost curve (``dataplane.cost_model.CostModel``) and named constants
(``PolicyConstants``). The engine (``dataplane.spec_step``), shadow evaluation, the
learner's simulated labels and the benchmarks call these functions; ``simulate``
walks one response exactly as the engine serves it.

One step, as the engine runs it:

1. ``reserve`` (before the drafter runs): per request, the most tokens it may verify
   this step, 1 meaning it does not draft (mode ``ar``, backed off, node backed off,
   a stale drafter context). ``per_request``: the request's cap (``fixed``, the paper's
   rule) or the best length at its estimated acceptance (break-even); ``budget``:
   ``allocate`` spreads the step's verify tokens across requests. The scheduler picks
   the batch from these reservations; the drafter runs only for the chosen requests.
2. ``choose`` (after the length head): each drafting request's verified length, at
   most its reservation. ``fixed``: the reservation. Paper rule (break-even off):
   k_hat = clamp(floor(gamma * a_hat * k), 1, k). Break-even: per-position acceptance p
   from gamma * a_hat (truncated geometric, ``position_accept``), calibrated node-wide and
   blended with the request's recent rounds; the m maximising expected tokens per unit of
   step time under the cost curve (``best_length``). A request whose best m does not pay
   for its drafter share backs off (skips drafting for ``backoff`` steps, doubling up to
   ``max_backoff``) and comes back through a probe: a short block of ``probe_length``
   tokens that resets the back-off when its draft is accepted (and, with other requests in
   the step, drafting would then pay at that batch). A node whose last pass paid for nobody skips the drafter for ``backoff``
   steps (doubling up to ``max_node_backoff``: it spans requests), then lets only
   ``probe_requests`` requests (taking turns) draft in its next pass. A drafter just set
   is on probation the same way: for its first ``warmup_rounds`` calibrated steps only
   ``probe_requests`` requests draft, each a probe, so an untrained head that claims high
   acceptance costs a few probes before calibration has measured it.
3. ``observe`` (after verification): the round joins the request's history, calibration
   (realised / predicted accepted drafts) is updated, and the node backs the drafter off
   when a pass paid for no request.

Acceptance inside a block is geometric with per-position probability p, so
E[accepted of m - 1 drafts] = p + ... + p^(m-1) and p is chosen so that the full block's
expected accepted drafts equal a * (k - 1) for the head's a.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Mode = Literal["ar", "fixed", "adaptive"]
PolicyKind = Literal["per_request", "budget"]


@dataclass(frozen=True)
class PolicyConstants:
    p_max: float = 0.98  # ceiling on a calibrated per-position acceptance
    head_p_max: float = 0.995  # ceiling of the head's a -> p inversion
    own_weight: float = 0.5  # weight of the request's own recent rounds against the head's p
    recent_rounds: int = 4  # drafting rounds of the request that estimate its own acceptance
    calib_min_weight: float = 0.05  # calibration EMA weight once past its bias-corrected start
    calib_floor: float = 0.05
    calib_ceiling: float = 4.0
    max_backoff: int = 16  # steps a request skips the drafter at most
    max_node_backoff: int = 64  # steps the node skips the drafter at most while its passes pay for nobody
    probe_length: int = 2  # verify tokens of an exploration probe (one draft)
    probe_requests: int = 2  # requests that draft in a pass while the node is backed off
    reset_share: float = 0.5  # a round keeping this share of its drafts resets the back-off
    unknown_p: float = 0.5  # budget policy: acceptance assumed for a request with no estimate yet
    warmup_rounds: int = 4  # calibrated steps a new drafter's head serves as probes before it is trusted
    min_gain: float = 1e-5  # budget policy: a verify token less likely kept than this is never worth its cost


CONSTANTS = PolicyConstants()


@dataclass(frozen=True)
class PolicyConfig:
    mode: Mode = "adaptive"
    block_size: int = 16
    gamma: float = 1.0
    breakeven: bool = True
    policy: PolicyKind = "per_request"
    max_verify_tokens: int = 512
    consts: PolicyConstants = CONSTANTS

    @classmethod
    def of(cls, dp) -> PolicyConfig:
        """From a ``DataplaneConfig`` (the node's typed configuration)."""
        return cls(mode=dp.mode, block_size=dp.block_size, gamma=dp.gamma, breakeven=dp.breakeven,
                   policy=dp.policy, max_verify_tokens=dp.max_verify_tokens)

    @property
    def node_backs_off(self) -> bool:
        return self.mode == "adaptive" and self.breakeven


@dataclass
class RoundOutcome:
    k_hat: int
    accepted: int


@dataclass
class RequestState:
    skip: int = 0  # steps left without drafting
    backoff: int = 1  # the next back-off's length
    probe: bool = False  # the next drafting round is an exploration probe
    p_est: float | None = None  # per-position acceptance estimated after its last round
    recent: list[RoundOutcome] = field(default_factory=list)  # its last drafting rounds


@dataclass
class NodeState:
    calib: float = 1.0  # EMA of realised / predicted accepted drafts
    calib_rounds: int = 0  # steps that fed it since the drafter was set
    skip: int = 0  # node-wide: steps left without running the drafter
    backoff: int = 1  # above 1: the node's last drafter pass paid for no request
    probe_turn: int = 0  # which eligible requests a backed-off node's next pass lets draft

    def reset(self) -> None:
        """A new drafter (and head): trust its head again and re-learn quickly."""
        self.calib, self.calib_rounds, self.skip, self.backoff, self.probe_turn = 1.0, 0, 0, 1, 0


class CostCurve(Protocol):
    draft_per_request_s: float

    def step_time(self, batch: int, tokens: int) -> float: ...


# -- acceptance model ------------------------------------------------------------------------------------
def paper_k_hat(a_hat: float, k: int, gamma: float) -> int:
    """The paper's verified length: clamp(floor(gamma * a_hat * k), 1, k)."""
    return int(min(k, max(1, math.floor(gamma * a_hat * k))))


def head_label(accepted, verified: int):
    """The head's label a* = accepted drafts / drafts verified (the paper's); ``accepted``: number or tensor."""
    return accepted / max(verified - 1, 1)


def expected_accepted(p: float, drafts: int) -> float:
    """Expected accepted drafts out of ``drafts`` at per-position acceptance p: p + ... + p^drafts."""
    if drafts <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(drafts)
    return p * (1.0 - p**drafts) / (1.0 - p)


def position_accept(accept_ratio: float, k: int, consts: PolicyConstants = CONSTANTS) -> float:
    """Per-position p whose expected accepted drafts out of k - 1 equal accept_ratio * (k - 1)
    (bisection on the truncated geometric mean), at most ``head_p_max``."""
    n = k - 1
    target = min(max(accept_ratio, 0.0), 1.0) * n
    if target <= 0.0 or n <= 0:
        return 0.0
    lo, hi = 0.0, consts.head_p_max
    if expected_accepted(hi, n) <= target:
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if expected_accepted(mid, n) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def head_p(a_hat: float, cfg: PolicyConfig, node: NodeState) -> float:
    """The head's per-position acceptance, calibrated node-wide."""
    return min(cfg.consts.p_max, position_accept(cfg.gamma * a_hat, cfg.block_size, cfg.consts) * node.calib)


def request_p(a_hat: float, req: RequestState, cfg: PolicyConfig, node: NodeState) -> float:
    """The head's calibrated p blended with the request's own recent rounds."""
    return _blend(head_p(a_hat, cfg, node), req.recent, cfg)


def _blend(p: float, recent: list[RoundOutcome], cfg: PolicyConfig) -> float:
    """p blended (``own_weight``) with the geometric estimate of the last rounds: accepted
    drafts over accepted drafts + rejections."""
    recent = recent[-cfg.consts.recent_rounds :]
    acc = sum(r.accepted for r in recent)
    rejections = sum(1 for r in recent if r.accepted < r.k_hat - 1)
    w = cfg.consts.own_weight
    return (1.0 - w) * p + w * acc / (acc + rejections) if acc + rejections else p


# -- lengths under the cost curve ---------------------------------------------------------------------------
def best_length(cost: CostCurve, p: float, cap: int, batch: int) -> tuple[int, float]:
    """(m, gain): the m in 1..cap maximising expected tokens per unit of step time at
    per-position acceptance p, for one request in a step of ``batch`` requests.

    The request's share of a plain step is T(B, B) / B; verifying m tokens adds
    T(B, B + m - 1) - T(B, B) (the others verifying one each). gain counts the drafter's
    share too: below 1, drafting did not pay for this request even at its best length.
    """
    batch = max(batch, 1)
    t_plain = cost.step_time(batch, batch)
    share = max(t_plain / batch, 1e-9)
    best_m, best_rate, tokens = 1, 1.0, 1.0
    for m in range(2, cap + 1):
        tokens += p ** (m - 1)
        extra = max(0.0, cost.step_time(batch, batch + m - 1) - t_plain)
        rate = tokens / (1.0 + extra / share)
        if rate > best_rate:
            best_m, best_rate = m, rate
    extra = max(0.0, cost.step_time(batch, batch + best_m - 1) - t_plain)
    gain = (1.0 + expected_accepted(p, best_m - 1)) / (1.0 + (extra + cost.draft_per_request_s) / share)
    return best_m, gain


def allocate(ps: Sequence[float], caps: Sequence[int], cost: CostCurve, budget: int,
             draft_s: float | None = None, min_gain: float = CONSTANTS.min_gain) -> list[int]:
    """The cross-request verify budget: lengths for a step of len(ps) requests.

    Every request verifies one token; more go, one at a time, to the request whose next
    draft is most likely kept (p_i^m for its m-th draft), within its cap and ``budget``,
    until p falls below ``min_gain``. The prefix of that order with the most expected
    tokens per second under the cost curve wins, ``draft_s`` per drafting request (default
    ``cost.draft_per_request_s``, 0 once the pass ran): a first draft carries the pass and
    step times are not smooth, so a longer block can pay where one more token does not."""
    draft_s = cost.draft_per_request_s if draft_s is None else draft_s
    n = len(ps)
    if n == 0:
        return []
    heap = [(-ps[i], i) for i in range(n) if caps[i] > 1 and ps[i] > 0.0]
    heapq.heapify(heap)
    lengths = [1] * n
    order: list[int] = []
    exp_tokens, total, drafting = float(n), n, 0
    best_rate, best_len = exp_tokens / cost.step_time(n, total), 0
    while heap and total < budget:
        neg, i = heapq.heappop(heap)
        gain = -neg
        if gain < min_gain:
            break
        drafting += lengths[i] == 1
        lengths[i] += 1
        order.append(i)
        exp_tokens, total = exp_tokens + gain, total + 1
        if lengths[i] < caps[i]:
            heapq.heappush(heap, (-(ps[i] ** lengths[i]), i))
        rate = exp_tokens / (cost.step_time(n, total) + drafting * draft_s)
        if rate > best_rate:
            best_rate, best_len = rate, len(order)
    out = [1] * n
    for i in order[:best_len]:
        out[i] += 1
    return out


# -- one step ---------------------------------------------------------------------------------------------------
def node_may_draft(cfg: PolicyConfig, node: NodeState) -> bool:
    """Node-wide back-off: False while the node skips the drafter (one step consumed)."""
    if cfg.node_backs_off and node.skip > 0:
        node.skip -= 1
        return False
    return True


def reserve(reqs: Sequence[RequestState], caps: Sequence[int], eligible: Sequence[bool], cfg: PolicyConfig,
            node: NodeState, cost: CostCurve, batch: int | None = None) -> list[int]:
    """Step 1, before the drafter: the most tokens each request may verify (1: no draft).

    eligible: the request could draft (a drafter is loaded and its context is this
    drafter's). Every request's back-off skip is consumed here, drafting or not.
    """
    out = [1] * len(reqs)
    may = [False] * len(reqs)
    for i, r in enumerate(reqs):
        may[i] = eligible[i] and r.skip == 0 and caps[i] > 1 and cfg.mode != "ar"
        r.skip = max(0, r.skip - 1)
    node_ok = node_may_draft(cfg, node)  # a node-wide skip step passes whether or not anyone could draft
    if cfg.mode == "ar" or not any(may) or not node_ok:
        return out
    if warming_up(cfg, node):  # probation: a few probes measure the new head before it is trusted
        _take_turns(may, cfg, node)
        return [min(c, cfg.consts.probe_length) if m else 1 for c, m in zip(caps, may, strict=True)]
    _probe_pass(may, cfg, node)
    batch = batch or len(reqs)
    if cfg.policy == "budget" and cfg.mode == "adaptive":
        unk = cfg.consts.unknown_p  # the pass is not charged here: ``choose`` backs off who it does not pay for
        ps = [(r.p_est if r.p_est is not None else unk) if m else 0.0 for r, m in zip(reqs, may, strict=True)]
        lims = [_probe_cap(r, c, cfg) if m else 1 for r, c, m in zip(reqs, caps, may, strict=True)]
        alloc = allocate(ps, lims, cost, cfg.max_verify_tokens, draft_s=0.0)
        return [max(a, 2) if m else 1 for a, m in zip(alloc, may, strict=True)]
    for i, r in enumerate(reqs):
        if not may[i]:
            continue
        cap = _probe_cap(r, caps[i], cfg)
        if cfg.mode == "adaptive" and cfg.breakeven and r.p_est is not None and not r.probe:
            cap = max(2, best_length(cost, r.p_est, cap, batch)[0])
        out[i] = cap
    return out


def warming_up(cfg: PolicyConfig, node: NodeState) -> bool:
    """The drafter was set fewer than ``warmup_rounds`` calibrated steps ago (its head's
    claims not yet measured against verification on this node)."""
    return cfg.node_backs_off and node.calib_rounds < cfg.consts.warmup_rounds


def _probe_pass(may: list[bool], cfg: PolicyConfig, node: NodeState) -> None:
    """While the node is backed off (its last pass paid for nobody), a pass only finds out
    whether drafting pays again: ``probe_requests`` of the eligible requests draft, taking
    turns, so the pass and its extra verify tokens cost what a few requests' share costs,
    not the whole batch's. ``may`` is narrowed in place."""
    if not cfg.node_backs_off or node.backoff <= 1:
        return
    _take_turns(may, cfg, node)


def _take_turns(may: list[bool], cfg: PolicyConfig, node: NodeState) -> None:
    """Narrow ``may`` in place to ``probe_requests`` of the eligible requests, taking turns."""
    idx = [i for i, m in enumerate(may) if m]
    n = cfg.consts.probe_requests
    if len(idx) <= n:
        return
    start = node.probe_turn % len(idx)
    keep = set((idx + idx)[start : start + n])
    node.probe_turn += n
    for i in idx:
        may[i] = i in keep


def _probe_cap(r: RequestState, cap: int, cfg: PolicyConfig) -> int:
    return min(cap, cfg.consts.probe_length) if r.probe and cfg.mode == "adaptive" else cap


def choose(reqs: Sequence[RequestState], a_hats: Sequence[float], reserved: Sequence[int], batch: int,
           cfg: PolicyConfig, node: NodeState, cost: CostCurve) -> tuple[list[int], bool]:
    """Step 2, after the length head: the verified length of each drafting request (at most
    its reservation), and whether drafting paid for any of them (node back-off).

    Backs off a request whose best length does not pay for its drafter share.
    """
    if cfg.mode == "fixed":
        return list(reserved), True
    if not cfg.breakeven:
        return [min(r, paper_k_hat(a, cfg.block_size, cfg.gamma)) for a, r in zip(a_hats, reserved,
                                                                                    strict=True)], True
    ps = [request_p(a, r, cfg, node) for a, r in zip(a_hats, reqs, strict=True)]
    if warming_up(cfg, node):  # probation probes are verified as reserved: calibration needs their rounds
        for r, p in zip(reqs, ps, strict=True):
            r.p_est = p
        return list(reserved), True
    if cfg.policy == "budget":  # the drafter has run: its pass is spent, as ``best_length`` counts it
        lengths = allocate(ps, reserved, cost, sum(reserved), draft_s=0.0)
    else:
        lengths = [best_length(cost, p, cap, batch)[0] for p, cap in zip(ps, reserved, strict=True)]
    paid = False
    for i, (r, p) in enumerate(zip(reqs, ps, strict=True)):
        r.p_est = p
        if r.probe:  # exploration: verify the probe whatever the estimate says; ``observe`` judges it
            lengths[i] = reserved[i]
            continue
        gain = _gain(cost, p, lengths[i], batch)
        paid |= gain >= 1.0
        if gain < 1.0:
            back_off(r, cfg)
    return lengths, paid


def back_off(r: RequestState, cfg: PolicyConfig) -> None:
    """Skip drafting for ``backoff`` steps (doubling up to ``max_backoff``), then probe."""
    r.skip = r.backoff
    r.backoff = min(cfg.consts.max_backoff, r.backoff * 2)
    r.probe = True


def _gain(cost: CostCurve, p: float, m: int, batch: int) -> float:
    if m <= 1:
        return best_length(cost, p, 1, batch)[1]
    t_plain = cost.step_time(batch, batch)
    share = max(t_plain / batch, 1e-9)
    extra = max(0.0, cost.step_time(batch, batch + m - 1) - t_plain)
    return (1.0 + expected_accepted(p, m - 1)) / (1.0 + (extra + cost.draft_per_request_s) / share)


def after_pass(cfg: PolicyConfig, node: NodeState, paid: bool) -> None:
    """Node-wide back-off after a drafter pass: one that paid for no request was pure cost;
    skip the drafter for ``backoff`` steps (doubling while passes stay useless)."""
    if not cfg.node_backs_off:
        return
    if paid:
        node.backoff = 1
    else:
        node.skip = node.backoff
        node.backoff = min(cfg.consts.max_node_backoff, 2 * node.backoff)


def observe(req: RequestState, k_hat: int, accepted: int, cfg: PolicyConfig, node: NodeState | None = None,
            cost: CostCurve | None = None, batch: int = 1) -> None:
    """Step 3, per request: its verified round joins its history; a round that kept enough
    of its drafts (a probe: its draft) ends the back-off, a probe that did not backs off.
    A kept probe ends the node's back-off too, unless (with ``cost``, ``batch`` > 1) drafting
    still would not pay for it at that batch at its updated acceptance: then it backs off again."""
    if k_hat <= 1:
        return
    req.recent.append(RoundOutcome(k_hat, accepted))
    del req.recent[: -cfg.consts.recent_rounds]
    if req.p_est is not None and cfg.breakeven:
        req.p_est = min(cfg.consts.p_max, _blend(req.p_est, req.recent, cfg))
    kept = accepted >= (k_hat - 1) * cfg.consts.reset_share
    if kept and req.probe and batch > 1 and cost is not None and cfg.breakeven and req.p_est is not None:
        kept = best_length(cost, req.p_est, cfg.block_size, batch)[1] >= 1.0
    if req.probe and node is not None and kept:
        node.skip, node.backoff = 0, 1
    if kept:
        req.backoff, req.probe = 1, False
    elif req.probe:  # a probe that kept too little (or whose text still would not pay): back off longer
        back_off(req, cfg)


def calibrate(node: NodeState, rounds: Sequence[tuple[int, float, int]], cfg: PolicyConfig) -> None:
    """Step 3, node-wide: EMA of realised / predicted accepted drafts over the rounds
    (k_hat, a_hat, accepted) that drafted. The first steps after a drafter is set average
    with weight 1/n (a bias-corrected start), later ones with ``calib_min_weight``."""
    pred = real = 0.0
    drafted = False
    for k, a_hat, acc in rounds:
        if k > 1:
            drafted = True
            pred += expected_accepted(position_accept(cfg.gamma * a_hat, cfg.block_size, cfg.consts), k - 1)
            real += acc
    if drafted:  # a step that verified drafts counts towards the warm-up, whatever its head predicted
        node.calib_rounds += 1
    if pred > 0:
        c = cfg.consts
        w = max(c.calib_min_weight, 1.0 / node.calib_rounds)
        node.calib = min(c.calib_ceiling, max(c.calib_floor, (1.0 - w) * node.calib + w * (real / pred)))


# -- a response walked as the engine serves it ------------------------------------------------------------------
@dataclass
class SimRound:
    anchor: int  # response offset of the round's last committed token
    k_hat: int
    accepted: int
    a_hat: float


def simulate(a_hats: Sequence[float], accepted_full: Sequence[int], n_tokens: int, cfg: PolicyConfig,
             cost: CostCurve, node: NodeState | None = None, batch: int = 1) -> list[SimRound]:
    """The rounds one request goes through, served alone at concurrency ``batch``.

    a_hats[i] / accepted_full[i]: the head's a_hat and the drafts of the full block that
    verification keeps (greedy: longest prefix equal to the target's tokens) at the anchor
    i tokens after the first response token; n_tokens: tokens committed after the first.
    Calls ``reserve``, ``choose``, ``after_pass``, ``calibrate`` and ``observe`` in the
    engine's order; ``node`` carries calibration and node back-off across requests.
    """
    node = node if node is not None else NodeState()
    req = RequestState()
    out: list[SimRound] = []
    pos = 0
    while pos < n_tokens:
        cap = min(cfg.block_size, n_tokens - pos)
        k = reserve([req], [cap], [True], cfg, node, cost, batch=batch)[0]
        a_hat = float(a_hats[pos])
        if k > 1:
            lengths, paid = choose([req], [a_hat], [k], batch, cfg, node, cost)
            after_pass(cfg, node, paid)
            k = lengths[0]
        acc = min(int(accepted_full[pos]), k - 1)
        calibrate(node, [(k, a_hat, acc)], cfg)
        observe(req, k, acc, cfg, node, cost, batch)
        out.append(SimRound(pos, k, acc, a_hat if k > 1 else 0.0))
        pos += acc + 1
    return out


# -- the head's calibration per block position --------------------------------------------------------------------
def position_ece(samples: Sequence[tuple[float, int, int]], cfg: PolicyConfig, calib: float = 1.0,
                 bins: int = 10) -> list[float]:
    """Expected calibration error of the head per block position i = 1..k-1.

    samples: (a_hat, accepted drafts of the full block, drafts available) per anchor. The
    head predicts draft i is kept with probability p^i (p: ``head_p`` at ``calib``); the
    outcome is accepted >= i. ECE_i = sum over equal-width bins of |mean predicted - share
    kept| weighted by the bin's share of the anchors where position i was available.
    """
    node = NodeState(calib=calib)
    ps = [head_p(a, cfg, node) for a, _, _ in samples]
    out = []
    for i in range(1, cfg.block_size):
        pairs = [(p**i, float(acc >= i)) for p, (_, acc, n) in zip(ps, samples, strict=True) if n >= i]
        if not pairs:
            out.append(0.0)
            continue
        ece = 0.0
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            inside = [(q, o) for q, o in pairs if lo <= q < hi or (b == bins - 1 and q >= 1.0)]
            if inside:
                ece += len(inside) / len(pairs) * abs(sum(q for q, _ in inside) / len(inside)
                                                     - sum(o for _, o in inside) / len(inside))
        out.append(ece)
    return out
