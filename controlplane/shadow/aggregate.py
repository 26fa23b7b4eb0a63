"""Aggregation of replays into an evaluation report.

tau of a drafter over a set of records = sum of committed tokens / sum of rounds, walked
by the node's policy at concurrency 1; per tenant and per domain (records without a
domain are "untagged"). Without a champion (the first candidate) the slices compare with
plain decoding (tau 1). Throughput at concurrency C = 1, 8, 32 comes from walks at batch
C, priced by the cost curve: C * tau_C / (step_time(C, C * verified per round) + C *
drafted share * draft cost per request). The cost curve is the one a node measured and
reported in its heartbeat (``cost_source``), else the cost model's priors.

Records are walked in window order with one ``NodeState`` per drafter and concurrency,
as a node serving them carries calibration and back-off across requests. The drafter's
traces (the expensive part) are cached by record; walks are recomputed every time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from adaflash.contracts.evaluation import (
    THROUGHPUT_CONCURRENCIES,
    Calibration,
    DrafterMetrics,
    EvaluationReport,
    ReliabilityBin,
    SliceMetrics,
    ThroughputPoint,
)
from adaflash.contracts.feedback import FeedbackRecord
from controlplane.shadow.replay import Replay, encode_record, target_pass, trace_drafter, walk
from dataplane import spec_policy as sp

UNTAGGED = "untagged"
N_BINS = 10


@dataclass
class Totals:
    rounds: float = 0.0
    committed: float = 0.0
    verified: float = 0.0
    drafted: float = 0.0
    records: int = 0

    def add(self, r: Replay) -> None:
        self.rounds += r.rounds
        self.committed += r.committed
        self.verified += r.verified
        self.drafted += r.drafted
        self.records += 1

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    def tps(self, cost, concurrency: int) -> float:
        """Predicted tokens per second of ``concurrency`` requests served like these."""
        if not self.rounds:
            return 0.0
        c = concurrency
        per_round = self.verified / self.rounds
        step = cost.step_time(c, max(c, int(round(c * per_round))))
        step += c * (self.drafted / self.rounds) * cost.draft_per_request_s
        return c * self.tau / step if step > 0 else 0.0


@dataclass
class DrafterAggregate:
    version: str
    policy: sp.PolicyConfig
    total: Totals = field(default_factory=Totals)
    at: dict[int, Totals] = field(default_factory=dict)  # concurrency -> totals of walks at that batch
    by_tenant: dict[str, Totals] = field(default_factory=dict)
    by_domain: dict[str, Totals] = field(default_factory=dict)
    accept_num: list[float] = field(default_factory=list)
    accept_den: list[float] = field(default_factory=list)
    calib: list[tuple[float, float, int]] = field(default_factory=list)
    sampled_tau: list[float] = field(default_factory=list)

    def add(self, rec: FeedbackRecord, walks: dict[int, Replay]) -> None:
        r = walks[1]
        self.total.add(r)
        for c, w in walks.items():
            self.at.setdefault(c, Totals()).add(w)
        self.by_tenant.setdefault(rec.tenant_id, Totals()).add(r)
        self.by_domain.setdefault(rec.domain or UNTAGGED, Totals()).add(r)
        tr = r.trace
        if len(self.accept_num) < len(tr.accept_num):
            pad = len(tr.accept_num) - len(self.accept_num)
            self.accept_num += [0.0] * pad
            self.accept_den += [0.0] * pad
        for i, (a, d) in enumerate(zip(tr.accept_num, tr.accept_den, strict=True)):
            self.accept_num[i] += a
            self.accept_den[i] += d
        self.calib += tr.calib
        if r.expected_tau is not None:
            self.sampled_tau.append(r.expected_tau)

    def calibration(self) -> Calibration | None:
        if not self.calib:
            return None
        pairs = [(a, x / n) for a, x, n in self.calib]
        mae = sum(abs(p - o) for p, o in pairs) / len(pairs)
        bins = []
        for b in range(N_BINS):
            lo, hi = b / N_BINS, (b + 1) / N_BINS
            inside = [(p, o) for p, o in pairs if lo <= p < hi or (b == N_BINS - 1 and p == 1.0)]
            if inside:
                bins.append(ReliabilityBin(lo=lo, hi=hi, predicted=_unit(sum(p for p, _ in inside) / len(inside)),
                                           observed=_unit(sum(o for _, o in inside) / len(inside)),
                                           count=len(inside)))
        ece = sp.position_ece([(a, int(round(x)), n) for a, x, n in self.calib], self.policy)
        return Calibration(mae=mae, bins=bins, position_ece=ece)

    def metrics(self, cost) -> DrafterMetrics:
        t = self.total
        throughput = [ThroughputPoint(concurrency=c, tokens_per_s=self.at[c].tps(cost, c), tau=self.at[c].tau)
                      for c in THROUGHPUT_CONCURRENCIES]
        return DrafterMetrics(
            version=self.version, tau=t.tau,
            expected_tau_sampled=(sum(self.sampled_tau) / len(self.sampled_tau)) if self.sampled_tau else None,
            acceptance_by_position=[_unit(n / d) if d else 0.0 for n, d in zip(self.accept_num, self.accept_den,
                                                                              strict=True)],
            verified_per_accepted=t.verified / t.committed if t.committed else 0.0,
            calibration=self.calibration(), throughput=throughput)


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def _slices(cand: dict[str, Totals], champ: dict[str, Totals] | None, cost) -> dict[str, SliceMetrics]:
    out = {}
    for key, t in sorted(cand.items()):
        c = champ.get(key) if champ else None
        out[key] = SliceMetrics(n_records=t.records, champion_tau=c.tau if c else 1.0, candidate_tau=t.tau,
                                champion_tps=c.tps(cost, 1) if c else ar_throughput(cost)[1],
                                candidate_tps=t.tps(cost, 1))
    return out


def ar_throughput(cost) -> dict[int, float]:
    """Plain decoding at the same concurrencies (tau 1, one verified token, no drafter)."""
    return {c: c / cost.step_time(c, c) for c in THROUGHPUT_CONCURRENCIES}


@dataclass
class ShadowResult:
    report: EvaluationReport
    skipped: int  # records of the window that could not be replayed (too short, too long)


def evaluate_drafters(target, tokenizer, records: Sequence[FeedbackRecord], candidate: tuple[str, object],
                      champion: tuple[str, object] | None, *, target_id: str, policy: sp.PolicyConfig,
                      max_tokens: int, cost=None, cost_source: str = "priors", now: datetime | None = None,
                      cache: dict | None = None) -> ShadowResult:
    """Replay ``records`` with the candidate (and the champion) and build the report.

    cache: drafter traces kept across calls, keyed by (record id, drafter name,
    max_tokens); the evaluator passes one so the champion is not traced again for every
    candidate (a name is a registry version, whose files never change).
    """
    from dataplane.cost_model import CostModel

    cost = cost or CostModel()
    drafters = [candidate] + ([champion] if champion else [])
    layers = sorted({int(x) for _, d in drafters for x in d.config.target_layers})
    pol = {name: dataclasses.replace(policy, block_size=d.config.block_size) for name, d in drafters}
    aggs = {name: DrafterAggregate(version=name, policy=pol[name]) for name, _ in drafters}
    nodes = {(name, c): sp.NodeState() for name, _ in drafters for c in THROUGHPUT_CONCURRENCIES}
    used: list[FeedbackRecord] = []
    skipped = n_greedy = n_sampled = 0
    for rec in records:
        enc = encode_record(tokenizer, rec, max_tokens)
        if enc is None:
            skipped += 1
            continue
        ids, start = enc
        sampled = rec.sampling.temperature > 0
        keys = {name: (rec.record_id, name, max_tokens) for name, _ in drafters}
        todo = [name for name, _ in drafters if cache is None or keys[name] not in cache]
        if todo:
            hidden, logits = target_pass(target, ids, layers, start if sampled else None)
        for name, d in drafters:
            if name in todo:
                cols = [layers.index(int(x)) for x in d.config.target_layers]
                tr = trace_drafter(d, hidden[:, cols], ids, start, temperature=rec.sampling.temperature,
                                   top_p=rec.sampling.top_p, target_logits=logits)
                if cache is not None:
                    cache[keys[name]] = tr
            else:
                tr = cache[keys[name]]
            aggs[name].add(rec, {c: walk(tr, pol[name], cost, nodes[(name, c)], batch=c)
                                 for c in THROUGHPUT_CONCURRENCIES})
        used.append(rec)
        n_sampled += int(sampled)
        n_greedy += int(not sampled)
    now = now or datetime.now(UTC)
    cand = aggs[candidate[0]]
    champ = aggs[champion[0]] if champion else None
    report = EvaluationReport(
        target_id=target_id, candidate_version=candidate[0], champion_version=champion[0] if champion else None,
        created_at=now, window_start=min((r.created_at for r in used), default=now),
        window_end=max((r.created_at for r in used), default=now), n_records=len(used), n_greedy=n_greedy,
        n_sampled=n_sampled, champion=champ.metrics(cost) if champ else None, candidate=cand.metrics(cost),
        per_tenant=_slices(cand.by_tenant, champ.by_tenant if champ else None, cost),
        per_domain=_slices(cand.by_domain, champ.by_domain if champ else None, cost), cost_source=cost_source)
    return ShadowResult(report=report, skipped=skipped)
