"""The speculation policy module: the paper's rule, break-even on a measured cost curve,
back-off and its probe, the cross-request budget, calibration and ECE per position."""

from __future__ import annotations

import pytest

from adaflash.contracts.cost_curve import CostCurve
from dataplane import spec_policy as sp
from dataplane.cost_model import CostModel


def _trusted() -> sp.NodeState:
    """A node whose drafter has passed its warm-up (its head calibrated on enough steps)."""
    return sp.NodeState(calib_rounds=sp.CONSTANTS.warmup_rounds)


def _linear(base=0.08, per_request=0.004, per_token=0.0025, draft=0.01) -> CostModel:
    return CostModel(base_s=base, per_request_s=per_request, per_token_s=per_token, draft_per_request_s=draft)


def _curve(times: dict[int, float], batch: int = 1, draft: float = 0.0) -> CostModel:
    """A measured curve at one batch: verify tokens -> seconds."""
    c = _linear(draft=draft)
    for t, s in times.items():
        c.set_point(batch, t, s)
    return c


# -- the paper's rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("a_hat", "gamma", "k_hat"), [(0.0, 1.0, 1), (0.05, 1.0, 1), (0.5, 1.0, 8), (0.99, 1.0, 15),
                                                       (1.0, 1.0, 16), (0.5, 1.3, 10), (0.9, 1.3, 16)])
def test_paper_rule(a_hat, gamma, k_hat):
    assert sp.paper_k_hat(a_hat, 16, gamma) == k_hat


def test_paper_rule_is_what_adaptive_mode_runs_without_breakeven():
    cfg = sp.PolicyConfig(block_size=16, breakeven=False)
    reqs = [sp.RequestState() for _ in range(3)]
    lengths, paid = sp.choose(reqs, [0.1, 0.5, 0.95], [16, 16, 4], 3, cfg, _trusted(), _linear())
    assert lengths == [1, 8, 4] and paid  # capped by the reservation


# -- the measured cost curve ---------------------------------------------------------------------------------
def test_cost_curve_interpolates_measured_points_and_falls_back_to_priors():
    c = _linear()
    assert c.step_time(4, 10) == pytest.approx(0.08 + 0.004 * 4 + 0.0025 * 10)  # nothing measured: priors
    c.observe_verify(1, 1, 0.010)
    assert not c.measured  # one step is not a measurement yet (warm-up)
    c.observe_verify(1, 1, 0.010)
    for _ in range(2):
        c.observe_verify(1, 4, 0.040)
        c.observe_verify(8, 8, 0.100)
    assert c.measured
    assert c.step_time(1, 1) == pytest.approx(0.010)
    assert c.step_time(1, 2) == pytest.approx(0.020)  # linear between 1 and 4 tokens
    assert c.step_time(1, 4) == pytest.approx(0.040)
    # batch 4 lies between the measured batches 1 and 8 (each extended along tokens)
    t1 = c.step_time(1, 8)
    assert c.step_time(4, 8) == pytest.approx(t1 + (0.100 - t1) * 3 / 7)


def test_cost_curve_snapshot_round_trips_through_the_contract():
    c = _curve({1: 0.01, 2: 0.011, 3: 0.012, 4: 0.03})
    c.set_products([(1, 0.001), (4, 0.012), (16, 0.02)])
    snap = c.snapshot()
    assert isinstance(snap, CostCurve) and snap.measured and len(snap.points) == 4 and len(snap.products) == 3
    back = CostModel.from_snapshot(CostCurve.model_validate_json(snap.model_dump_json()))
    for t in (1, 2, 3, 4, 6, 40):
        assert back.step_time(1, t) == pytest.approx(c.step_time(1, t))
    assert back.step_time(1, 3) > 0.012  # the products' floor travels with the curve
    assert not _linear().snapshot().measured


def test_extra_verify_tokens_never_cost_less_than_their_products():
    """Noisy steps at C=32 (as measured on a 2-core Zen 4): 40 tokens looked cheaper than 32,
    so drafting looked free. The products of the eight extra rows bound it from below, and
    a draft kept with p = 0.3 no longer pays there."""
    c = _linear()
    for tokens, s in ((32, 0.0581), (40, 0.0550)):
        c.set_point(32, tokens, s)
    assert c.step_time(32, 40) < c.step_time(32, 32)
    assert sp.best_length(c, 0.3, 16, 32)[0] > 1
    c.set_products([(1, 0.0120), (8, 0.0116), (32, 0.0263), (64, 0.0480)])  # non-decreasing once set
    assert c.products_time(8) == pytest.approx(0.0120) and c.products_time(128) == pytest.approx(0.0914)
    assert c.step_time(32, 40) == pytest.approx(0.0581 + (0.0263 + (0.0480 - 0.0263) / 4) - 0.0263)
    assert c.step_time(32, 32) == pytest.approx(0.0581)  # a plain step is what was measured
    assert sp.best_length(c, 0.3, 16, 32)[0] == 1
    cheap = _curve({1: 0.010, 16: 0.019}, draft=0.0)  # where the step curve is above the floor, it rules
    cheap.set_products([(1, 0.009), (16, 0.012)])
    assert cheap.step_time(1, 16) == pytest.approx(0.019)


# -- break-even ---------------------------------------------------------------------------------------------
def test_best_length_follows_a_non_linear_curve():
    """Three rows cost about one, the fourth costs far more (a CPU's step): stop at three,
    which a linear fit through the same points would not see."""
    c = _curve({1: 0.010, 2: 0.0102, 3: 0.0104, 4: 0.030, 5: 0.0302, 6: 0.0304, 7: 0.0306, 8: 0.0308})
    m, gain = sp.best_length(c, 0.7, 8, 1)
    assert m == 3 and gain > 1.0


def test_breakeven_backs_off_then_probes_with_a_short_block():
    cfg = sp.PolicyConfig(block_size=8)
    cost = _curve({t: 0.01 * t for t in range(1, 9)}, draft=0.005)  # every verify token costs a full step
    node, req = _trusted(), sp.RequestState()
    lengths, paid = sp.choose([req], [0.3], [8], 1, cfg, node, cost)
    assert lengths == [1] and not paid
    assert req.skip == 1 and req.backoff == 2 and req.probe
    # the back-off is consumed before drafting; the next drafting round is a probe of one draft
    assert sp.reserve([req], [8], [True], cfg, node, cost) == [1]
    assert sp.reserve([req], [8], [True], cfg, node, cost) == [cfg.consts.probe_length]
    # the probe's draft was accepted: the back-off ends and full blocks come back
    sp.observe(req, 2, 1, cfg)
    assert req.backoff == 1 and not req.probe
    req.p_est = None
    assert sp.reserve([req], [8], [True], cfg, node, cost) == [8]


def test_a_kept_probe_ends_the_back_off_only_where_drafting_then_pays_at_this_batch():
    """At C=16 on a CPU whose extra verify rows are bound by arithmetic, a probe that kept its
    one draft does not show that drafting pays: the request backs off longer and the node
    stays backed off. At C=1, where verify rows are cheap, the same probe ends both."""
    cfg = sp.PolicyConfig(block_size=16)
    busy = _linear(base=0.0, per_request=0.004, per_token=0.0, draft=0.004)
    busy.set_point(16, 16, 0.064)
    busy.set_point(16, 32, 0.128)  # every extra row costs a request's whole share
    quiet = _curve({1: 0.012, 2: 0.0121, 16: 0.014}, draft=0.001)
    for cost, batch, ends in ((busy, 16, False), (quiet, 1, True), (None, 16, True)):
        node = sp.NodeState(backoff=8)
        r = sp.RequestState(probe=True, backoff=4, p_est=0.35)
        sp.observe(r, 2, 1, cfg, node, cost, batch)  # the probe's draft was kept
        assert (node.backoff == 1) is ends and r.probe is not ends
        if not ends:
            assert (r.skip, r.backoff, node.backoff) == (4, 8, 8)


def test_failed_probes_double_the_back_off_up_to_its_ceiling():
    cfg = sp.PolicyConfig(block_size=8)
    cost = _curve({t: 0.01 * t for t in range(1, 9)}, draft=0.005)
    req = sp.RequestState()
    for _ in range(8):
        sp.choose([req], [0.05], [2], 1, cfg, _trusted(), cost)
        sp.observe(req, 2, 0, cfg)
    assert req.backoff == cfg.consts.max_backoff and req.probe


def test_a_backed_off_node_probes_with_a_few_requests_taking_turns():
    cfg = sp.PolicyConfig(block_size=8)
    n = cfg.consts.probe_requests
    reqs = [sp.RequestState() for _ in range(6)]
    node = _trusted()
    assert sp.reserve(reqs, [8] * 6, [True] * 6, cfg, node, _linear()).count(1) == 0  # all draft
    sp.after_pass(cfg, node, paid=False)  # that pass paid for nobody
    node.skip = 0
    seen = []
    for _ in range(3):
        out = sp.reserve(reqs, [8] * 6, [True] * 6, cfg, node, _linear())
        seen.append({i for i, k in enumerate(out) if k > 1})
    assert all(len(s) == n for s in seen)
    assert set().union(*seen) == set(range(6))  # everyone's turn comes
    sp.after_pass(cfg, node, paid=True)  # drafting paid again: the whole batch drafts
    assert 1 not in sp.reserve(reqs, [8] * 6, [True] * 6, cfg, node, _linear())


def test_node_backs_off_when_a_pass_pays_for_nobody():
    cfg = sp.PolicyConfig(block_size=8)
    node = _trusted()
    sp.after_pass(cfg, node, paid=False)
    sp.after_pass(cfg, node, paid=False)
    assert node.skip == 2 and node.backoff == 4
    assert sp.reserve([sp.RequestState()], [8], [True], cfg, node, _linear()) == [1]
    sp.after_pass(cfg, node, paid=True)
    assert node.backoff == 1


def test_node_back_off_outgrows_a_requests_ceiling_up_to_its_own():
    cfg = sp.PolicyConfig(block_size=8)
    consts = cfg.consts
    assert consts.max_node_backoff > consts.max_backoff  # the node's skip spans requests
    node = _trusted()
    skips = []
    for _ in range(10):
        sp.after_pass(cfg, node, paid=False)
        skips.append(node.skip)
    assert max(skips) == consts.max_node_backoff and skips[-1] == consts.max_node_backoff
    assert skips[:4] == [1, 2, 4, 8]  # doubling, as before


# -- the cross-request budget ---------------------------------------------------------------------------------
def test_budget_gives_tokens_to_the_requests_most_likely_to_keep_them():
    cost = _linear(base=0.05, per_request=0.0, per_token=0.001, draft=0.0)
    lengths = sp.allocate([0.9, 0.2, 0.0], [16, 16, 16], cost, budget=64)
    assert lengths[0] > lengths[1] > 1 and lengths[2] == 1
    # each extra token's acceptance probability is at least every refused token's
    taken = [0.9 ** m for m in range(1, lengths[0])] + [0.2 ** m for m in range(1, lengths[1])]
    refused = [0.9 ** lengths[0], 0.2 ** lengths[1]]
    assert min(taken) >= max(refused)


def test_budget_respects_the_token_budget_and_the_caps():
    cost = _linear(base=1.0, per_request=0.0, per_token=1e-6, draft=0.0)  # tokens nearly free
    assert sum(sp.allocate([0.99] * 4, [16] * 4, cost, budget=20)) == 20
    assert sp.allocate([0.99, 0.99], [3, 16], cost, budget=64) == [3, 16]


def test_budget_stops_where_a_token_costs_more_than_it_brings():
    cost = _linear(base=0.0, per_request=0.0, per_token=0.01, draft=0.0)  # every token a full step
    assert sp.allocate([0.6, 0.6], [16, 16], cost, budget=64) == [1, 1]


def test_budget_policy_reserves_before_drafting():
    cfg = sp.PolicyConfig(block_size=16, policy="budget", max_verify_tokens=24)
    reqs = [sp.RequestState(p_est=0.9), sp.RequestState(p_est=0.1), sp.RequestState(skip=2)]
    cost = _linear(base=0.05, per_request=0.0, per_token=0.0005, draft=0.0)
    res = sp.reserve(reqs, [16, 16, 16], [True] * 3, cfg, _trusted(), cost)
    assert res[2] == 1 and res[0] > res[1] >= 2 and sum(res) <= 24 + 1


# -- calibration --------------------------------------------------------------------------------------------------
def test_ece_per_position_is_zero_for_a_calibrated_head_and_large_for_an_overconfident_one():
    import random

    cfg = sp.PolicyConfig(block_size=8)
    a = 0.5
    p = sp.head_p(a, cfg, _trusted())
    rng = random.Random(0)
    good, bad = [], []
    for _ in range(4000):
        acc = 0
        while acc < 7 and rng.random() < p:
            acc += 1
        good.append((a, acc, 7))
        bad.append((a, 0, 7))
    ece_good = sp.position_ece(good, cfg)
    ece_bad = sp.position_ece(bad, cfg)
    assert len(ece_good) == 7
    assert max(ece_good) < 0.03
    assert ece_bad[0] == pytest.approx(p, abs=1e-6) and all(b > g for b, g in zip(ece_bad, ece_good, strict=True))


# -- a whole response ------------------------------------------------------------------------------------------------
def test_simulate_walks_the_response_with_the_policy():
    cfg = sp.PolicyConfig(block_size=8, breakeven=False)
    n = 30
    rounds = sp.simulate([0.5] * n, [7] * n, n, cfg, _linear())
    assert [r.k_hat for r in rounds][:3] == [4, 4, 4]
    assert sum(r.accepted + 1 for r in rounds) == n
    assert all(r.accepted == min(7, r.k_hat - 1) for r in rounds[:-1])


# -- the engine under each policy --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["per_request", "budget"])
def test_engine_serves_losslessly_under_each_policy_and_drafts_only_for_the_chosen(tiny_target, policy):
    """A tight verify budget: the scheduler picks the batch from the reservations before the
    drafter runs; the drafter drafts only for the requests chosen; outputs equal ar."""
    from dataplane.drafter import new_drafter
    from tests.dataplane.engine_util import make_engine, prompts, run

    d = new_drafter(tiny_target, seed=5, num_layers=1, n_target_layers=2, block_size=8, head_hidden=16)
    drafted: list[int] = []
    orig = d.forward_block
    d.forward_block = lambda last, kvs: drafted.append(len(kvs)) or orig(last, kvs)
    ps = prompts(10, 97, seed=8)
    eng = make_engine(tiny_target, drafter=d, max_running=8, max_verify_tokens=12, policy=policy)
    eng.cost = eng.step_runner.cost = _linear(base=0.05, per_request=0.0, per_token=0.0002, draft=0.0)
    eng.cost.observe_verify = lambda *a: None
    chosen: list[int] = []
    select = eng.scheduler.select
    eng.scheduler.select = lambda sizes: (lambda c: chosen.append(len(c)) or c)(select(sizes))
    out = [s.output_ids for s in run(eng, ps, max_tokens=16)]
    ar = [s.output_ids for s in run(make_engine(tiny_target, mode="ar", max_running=8), ps, max_tokens=16)]
    assert out == ar
    assert drafted and max(drafted) <= max(chosen)


def test_a_new_drafter_serves_a_few_probes_before_its_head_is_trusted():
    """An untrained head claiming high acceptance: while the node has calibrated fewer than
    warmup_rounds steps, only probe_requests requests draft, each a probe of probe_length
    tokens verified as reserved; once calibration measured the head, it backs off."""
    cfg = sp.PolicyConfig(block_size=8)
    cost = _curve({t: 0.01 * (1 + 0.05 * t) for t in range(1, 65)}, draft=0.002)
    node, reqs = sp.NodeState(), [sp.RequestState() for _ in range(6)]
    c = sp.CONSTANTS
    for step in range(c.warmup_rounds):
        res = sp.reserve(reqs, [8] * 6, [True] * 6, cfg, node, cost)
        drafting = [i for i, r in enumerate(res) if r > 1]
        assert len(drafting) == c.probe_requests and all(res[i] == c.probe_length for i in drafting), (step, res)
        lengths, paid = sp.choose([reqs[i] for i in drafting], [0.9] * len(drafting), [res[i] for i in drafting],
                                  6, cfg, node, cost)
        assert lengths == [c.probe_length] * len(drafting) and paid
        sp.calibrate(node, [(k, 0.9, 0) for k in lengths], cfg)  # every probe's draft rejected
    assert not sp.warming_up(cfg, node) and node.calib <= c.calib_floor + 1e-9
    res = sp.reserve(reqs, [8] * 6, [True] * 6, cfg, node, cost)
    drafting = [i for i, r in enumerate(res) if r > 1]
    lengths, paid = sp.choose([reqs[i] for i in drafting], [0.9] * len(drafting), [res[i] for i in drafting],
                              6, cfg, node, cost)
    assert not paid and all(reqs[i].skip > 0 for i in drafting)  # measured: drafting does not pay, back off


def test_budget_finds_a_block_that_pays_where_one_more_token_does_not():
    """The drafter's pass is paid once per drafting request: one draft of p = 0.5 does not
    cover it, three do. The budget walks past the first token that does not pay."""
    cost = _linear(base=1.0, per_request=0.0, per_token=0.0, draft=0.6)
    assert (1 + 0.5) / 1.6 < 1.0 < (1 + 0.5 + 0.25 + 0.125) / 1.6
    lengths = sp.allocate([0.5], [8], cost, budget=64)
    assert lengths[0] >= 4
    assert sp.allocate([0.2], [8], cost, budget=64) == [1]  # (1 + 0.25) / 1.6: no block of p = 0.2 pays
    # after the head the pass is spent: the drafts made are verified where they bring tokens
    assert sp.allocate([0.2], [8], cost, budget=64, draft_s=0.0)[0] > 1


def test_budget_walks_over_a_bump_in_the_cost_curve():
    """Measured step times are not smooth (here four tokens cost more than eight)."""

    class Bumpy:
        draft_per_request_s = 0.0

        def step_time(self, batch, tokens):
            return {1: 1.0, 2: 1.3, 3: 1.5, 4: 1.9}.get(tokens, 1.35 + 0.01 * tokens)

    assert sp.allocate([0.7], [16], Bumpy(), budget=64)[0] > 4


def test_budget_of_one_request_drafts_as_the_per_request_rule():
    """With one request there is nothing to share: the budget must find the same lengths as
    the per-request rule on a measured, non-smooth C=1 curve (here eight tokens cost less than
    four), for predictable and unpredictable text alike."""
    import random

    cost = _curve({1: 0.0169, 2: 0.0183, 3: 0.0189, 4: 0.0203, 5: 0.0203, 8: 0.0194, 16: 0.0211}, draft=0.0025)
    rng = random.Random(3)
    accepted, a_hats = [], []
    for _ in range(3000):
        p = rng.choice([0.05, 0.1, 0.3, 0.6, 0.85])
        acc = 0
        while acc < 15 and rng.random() < p:
            acc += 1
        accepted.append(acc)
        a_hats.append(sum(p**j for j in range(1, 16)) / 15)
    verified = {}
    for policy in ("per_request", "budget"):
        rounds = sp.simulate(a_hats, accepted, 2800, sp.PolicyConfig(policy=policy), cost)
        verified[policy] = [r.k_hat for r in rounds]
    assert sum(verified["per_request"]) / len(verified["per_request"]) > 2.0
    assert verified["budget"] == verified["per_request"]
