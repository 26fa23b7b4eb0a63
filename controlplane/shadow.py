"""Shadow evaluation: champion and candidate replayed on held-out, recent, scrubbed feedback.

The window
    Feedback comes from a ``FeedbackWindow`` (the Kafka feedback topic read from its
    tail, or a JSONL file / list for tests and offline runs). Only records reserved
    for evaluation are used (``adaflash.contracts.feedback.is_evaluation_record``: the
    learner never trains on them), inside their tenant's feedback TTL, from tenants
    that have not opted out, for this target; the newest ``max_records`` are kept.

The replay (one record)
    prompt_text and response_text are re-tokenized with the target tokenizer and the
    frozen target runs once over prompt + response, returning the hidden states of
    the layers the drafters read. The realised response tokens are what the target
    committed; at temperature 0 they are the target's argmax, so a draft is accepted
    exactly when it equals them. Each drafter drafts a block at every anchor (every
    response position but the last, the token at the anchor being the last committed
    one, exactly as the engine does after a round):
    - greedy records: accepted(anchor) = longest prefix of the block's drafts equal to
      the realised tokens. A walk from the first response token, advancing by
      accepted + 1 with the length head's k_hat (the node's adaptive mode, gamma from
      the dataplane config; the break-even rule is not simulated) gives rounds,
      committed and verified tokens; tau = committed tokens / rounds.
    - sampled records (temperature > 0): the drafts are random, so the expected number
      accepted at an anchor is sum_i prod_{j<=i} alpha_j with alpha_j = sum_x min(p_j(x),
      q_j(x)) = E_{x~q}[min(1, p/q)], p the target's and q the drafter's sampling
      distributions (same temperature and top-p), conditioned on the realised prefix.
      rounds = tokens / mean(1 + expected accepted within k_hat).
    - acceptance by block position i: share of anchors whose drafts 0..i were all
      accepted (full block, k_hat not applied); sampled records add prod_{j<=i} alpha_j.
    - length-head calibration: per anchor, a_hat against the realised accepted share of
      the available drafts (accepted / min(k - 1, tokens left)); MAE and a 10-bin
      reliability curve.
    - verified_per_accepted: verified tokens per committed token (accepted drafts plus
      the target's own token of each round, as in tau), so it stays finite when
      nothing is accepted.

Aggregates
    tau of a drafter over a set of records = sum of committed tokens / sum of rounds;
    per tenant and per domain (records without a domain are "untagged"). Without a
    champion (the first candidate) the slices compare with plain decoding (tau 1).
    Throughput at concurrency C = 1, 8, 32 is predicted from the dataplane cost model
    (``dataplane.cost_model.CostModel``): C * tau / (step_time(C, C * verified per round)
    + C * draft cost per request). Its coefficients are the cost model's defaults until
    nodes report measured ones in their heartbeats.

The worker stores the report (EvaluationReport JSON) and PNG plots under the
evaluations directory, links them from the evaluations table, then applies the gates.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from adaflash.contracts.evaluation import (
    THROUGHPUT_CONCURRENCIES,
    Calibration,
    DrafterMetrics,
    EvaluationReport,
    ReliabilityBin,
    SliceMetrics,
    ThroughputPoint,
)
from adaflash.contracts.feedback import FeedbackRecord, InvalidRecord, is_evaluation_record
from adaflash.telemetry import CONTROLPLANE, SpanAttrs, Spans, tracer
from controlplane import deletion, eval_window, lifecycle
from controlplane.api.routes.evaluations import evaluations_dir
from controlplane.db import session_scope, utcnow
from controlplane.gates import GatePolicy
from controlplane.models import Evaluation, Tenant, Version
from controlplane.registry import ArtifactIntegrityError, Registry
from controlplane.states import VersionState

log = logging.getLogger("adaflash.controlplane.shadow")
_tracer = tracer(__name__, service=CONTROLPLANE)

SYSTEM_SHADOW = "system:shadow"
UNTAGGED = "untagged"
N_BINS = 10


# -- feedback windows ----------------------------------------------------------------------------------
class FeedbackWindow(Protocol):
    """Where recent feedback records come from (unfiltered: ``select_window`` filters)."""

    def read(self) -> Iterable[FeedbackRecord]: ...


class RecordsWindow:
    """Records from a list, or from a JSONL file of FeedbackRecord JSON (one per line)."""

    def __init__(self, records: Iterable[FeedbackRecord | Mapping] | None = None, path: str | Path | None = None):
        self._records = list(records or [])
        self.path = Path(path) if path else None

    def read(self) -> Iterator[FeedbackRecord]:
        for r in self._records:
            yield r if isinstance(r, FeedbackRecord) else FeedbackRecord.model_validate(r)
        if self.path is not None and self.path.is_file():
            with self.path.open() as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield FeedbackRecord.from_bytes(line)
                        except InvalidRecord as e:
                            log.warning("%s:%d skipped: %s", self.path, n, e)


class KafkaFeedbackWindow:
    """The last ``per_partition`` records of every partition of the feedback topic.

    A plain consumer without a group (nothing committed, no rebalance): it seeks each
    partition to end - per_partition and reads up to the end offsets it saw first.
    """

    def __init__(self, bootstrap: str, topic: str, per_partition: int = 500, timeout_s: float = 20.0):
        self.bootstrap, self.topic = bootstrap, topic
        self.per_partition, self.timeout_s = per_partition, timeout_s
        self.invalid = 0

    def read(self) -> list[FeedbackRecord]:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                 request_timeout_ms=int(self.timeout_s * 1000) + 5000)
        try:
            parts = consumer.partitions_for_topic(self.topic) or set()
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            if not tps:
                return []
            consumer.assign(tps)
            ends = consumer.end_offsets(tps)
            begins = consumer.beginning_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(begins.get(tp) or 0, (ends.get(tp) or 0) - self.per_partition))
            # Keep the last per_partition records of each partition. Read until every position
            # passed its end offset and a poll comes back empty: a broker that under-reports its
            # end offsets (the embedded Tansu does) is then read to its real end.
            tails = {tp: deque(maxlen=self.per_partition) for tp in tps}
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                batch = consumer.poll(timeout_ms=500, max_records=2000)
                for tp, msgs in batch.items():
                    tails[tp].extend(m.value for m in msgs)
                if not batch and all(consumer.position(tp) >= (ends.get(tp) or 0) for tp in tps):
                    break
            else:
                log.warning("feedback window read stopped after %.0f s", self.timeout_s)
            out: list[FeedbackRecord] = []
            for tp in tps:
                for raw in tails[tp]:
                    try:
                        out.append(FeedbackRecord.from_bytes(raw))
                    except InvalidRecord:
                        self.invalid += 1
            return out
        finally:
            consumer.close()


def window_from_settings(settings: Settings) -> FeedbackWindow:
    cp = settings.controlplane
    if cp.feedback_source == "jsonl":
        return RecordsWindow(path=cp.feedback_jsonl)
    if cp.feedback_source == "none":
        return RecordsWindow()
    return KafkaFeedbackWindow(settings.kafka.bootstrap, settings.kafka.feedback_topic,
                               per_partition=cp.shadow_per_partition)


def select_window(records: Iterable[FeedbackRecord], *, now: datetime, target_id: str | None,
                  tenant_ttl_days: Mapping[str, float], default_ttl_days: float, opted_out: Iterable[str] = (),
                  max_records: int = 2000, deleted_before: Mapping[str, datetime] | None = None
                  ) -> list[FeedbackRecord]:
    """Held-out records inside their tenant's TTL, newest ``max_records`` first, deduplicated.

    deleted_before: tenant -> time of its deletion request; records created up to it are
    refused (Kafka keeps them until retention passes, the platform must not use them).
    """
    opted = set(opted_out)
    deleted = dict(deleted_before or {})
    seen: dict[str, FeedbackRecord] = {}
    for r in records:
        if r.record_id in seen or not is_evaluation_record(r.record_id) or r.tenant_id in opted:
            continue
        if r.tenant_id in deleted and r.created_at <= deleted[r.tenant_id]:
            continue
        if target_id is not None and r.target_model.id != target_id:
            continue
        ttl = tenant_ttl_days.get(r.tenant_id, default_ttl_days)
        if r.created_at < now - timedelta(days=ttl) or r.created_at > now + timedelta(minutes=5):
            continue
        seen[r.record_id] = r
    newest = sorted(seen.values(), key=lambda r: r.created_at, reverse=True)[:max_records]
    return sorted(newest, key=lambda r: r.created_at)


# -- replay ---------------------------------------------------------------------------------------------------
@dataclass
class Replay:
    """One drafter on one record."""

    tokens: int = 0  # response tokens committed by rounds (all but the first, which prefill makes)
    rounds: float = 0.0
    verified: float = 0.0  # tokens verified by the target over those rounds
    committed: float = 0.0  # tokens committed by those rounds (== tokens)
    accept_num: list[float] = field(default_factory=list)  # per block position: accepted (sum)
    accept_den: list[float] = field(default_factory=list)  # per block position: anchors with it available
    calib: list[tuple[float, float]] = field(default_factory=list)  # (a_hat, realised share) per anchor
    expected_tau: float | None = None  # sampled records: mean 1 + expected accepted per anchor


@torch.inference_mode()
def target_pass(target, ids: list[int], layers: Sequence[int], want_logits_from: int | None):
    """One frozen-target forward over ``ids``: hidden states [L, len(layers), H] and, when
    asked, the logits of rows ``want_logits_from``..L-2 (each predicting the next token)."""
    L = len(ids)
    kv = target.new_cache(capacity=L)
    idx = (torch.arange(want_logits_from, L - 1, dtype=torch.int64) if want_logits_from is not None
           else torch.empty(0, dtype=torch.int64))
    out = target.forward_packed(torch.tensor(ids, dtype=torch.int64), [0, L], [kv], logits_index=idx,
                                hidden_layers=tuple(layers))
    return out.hidden, out.logits


@torch.inference_mode()
def replay_drafter(drafter, hidden: torch.Tensor, ids: list[int], start: int, *, gamma: float,
                   temperature: float = 0.0, top_p: float = 1.0, target_logits: torch.Tensor | None = None,
                   chunk: int = 32) -> Replay:
    """Simulate ``drafter`` on one sequence whose response starts at index ``start``.

    hidden: the target's hidden states of the drafter's layers [L, n, H]; anchors are
    start..L-2. target_logits (sampled records): rows for positions start..L-2.
    """
    from dataplane.drafter import k_hat_from
    from dataplane.verify import process_logits

    L = len(ids)
    k = drafter.config.block_size
    rep = Replay(accept_num=[0.0] * (k - 1), accept_den=[0.0] * (k - 1))
    if start < 1 or L - 1 - start < 1:
        return rep
    tokens = torch.tensor(ids, dtype=torch.int64)
    anchors_all = torch.arange(start, L - 1, dtype=torch.int64)
    greedy = temperature <= 0
    a_hats: list[float] = []
    full_acc: list[float] = []  # greedy: accepted drafts of the full block; sampled: expected
    alphas: list[torch.Tensor] = []  # sampled: per anchor [n_avail] acceptance probabilities
    p_all = None
    if not greedy:
        p_all = process_logits(target_logits, temperature, top_p)  # [L-1-start, V]
    for c in range(0, anchors_all.numel(), chunk):
        anchors = anchors_all[c : c + chunk]
        h = drafter.forward_train(hidden, tokens, anchors)  # [A, k, H]
        a_hat = drafter.length_head(h).float()
        n_avail = torch.clamp(L - 1 - anchors, max=k - 1)
        a_hats += a_hat.tolist()
        if greedy:
            # Position by position, only where every earlier draft matched: a draft after the
            # first mismatch can never be accepted, so its logits are not computed.
            acc = torch.zeros(anchors.numel(), dtype=torch.int64)
            alive = torch.ones(anchors.numel(), dtype=torch.bool)
            for i in range(k - 1):
                idx = (alive & (n_avail > i)).nonzero().squeeze(1)
                if idx.numel() == 0:
                    break
                drafts = drafter.to_target_ids(drafter.logits(h[idx, i + 1]).argmax(-1))
                ok = drafts == tokens[anchors[idx] + 1 + i]
                acc[idx[ok]] += 1
                alive[idx[~ok]] = False
            full_acc += acc.tolist()
            for i in range(k - 1):
                rep.accept_den[i] += float((n_avail > i).sum())
                rep.accept_num[i] += float((acc > i).sum())
            rep.calib += [(a, x / n) for a, x, n in zip(a_hat.tolist(), acc.tolist(), n_avail.tolist(), strict=True)]
            continue
        q = drafter.expand_probs(process_logits(drafter.logits(h[:, 1:]), temperature, top_p))  # [A, k-1, V]
        for j, a in enumerate(anchors.tolist()):
            n = int(n_avail[j])
            rows = p_all[a - start : a - start + n]  # p of tokens a+1..a+n
            alpha = torch.minimum(rows, q[j, :n]).sum(-1).clamp(0.0, 1.0)
            surv = torch.cumprod(alpha, 0)
            alphas.append(surv)
            full_acc.append(float(surv.sum()))
            for i in range(n):
                rep.accept_den[i] += 1
                rep.accept_num[i] += float(surv[i])
            rep.calib.append((float(a_hat[j]), full_acc[-1] / n))
    k_hat = k_hat_from(torch.tensor(a_hats), k, gamma).tolist()
    rep.tokens = L - 1 - start
    if greedy:
        a = start
        while a < L - 1:
            i = a - start
            # As the engine caps k_hat: the round's own (bonus) token must fit in the response.
            n = min(int(k_hat[i]), L - 1 - a) - 1
            acc = min(int(full_acc[i]), n)
            rep.rounds += 1
            rep.verified += n + 1
            rep.committed += acc + 1
            a += acc + 1
    else:
        exp_tau, verified = [], []
        for i, surv in enumerate(alphas):
            n = min(int(k_hat[i]), surv.numel()) - 1
            exp_tau.append(1.0 + float(surv[:n].sum()))
            verified.append(n + 1)
        mean_tau = sum(exp_tau) / len(exp_tau)
        rep.expected_tau = mean_tau
        rep.rounds = rep.tokens / mean_tau
        rep.committed = float(rep.tokens)
        rep.verified = rep.rounds * (sum(verified) / len(verified))
    return rep


def encode_record(tokenizer, record: FeedbackRecord, max_tokens: int) -> tuple[list[int], int] | None:
    """prompt + response ids (response cut to fit ``max_tokens``) and the response start."""
    prompt = tokenizer.encode(record.prompt_text)
    response = tokenizer.encode(record.response_text)
    if not prompt or len(response) < 2:
        return None
    if len(prompt) >= max_tokens - 2:
        return None
    response = response[: max_tokens - len(prompt)]
    return prompt + response, len(prompt)


# -- aggregation --------------------------------------------------------------------------------------
@dataclass
class Totals:
    rounds: float = 0.0
    committed: float = 0.0
    verified: float = 0.0
    records: int = 0

    def add(self, r: Replay) -> None:
        self.rounds += r.rounds
        self.committed += r.committed
        self.verified += r.verified
        self.records += 1

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0


@dataclass
class DrafterAggregate:
    version: str
    total: Totals = field(default_factory=Totals)
    by_tenant: dict[str, Totals] = field(default_factory=dict)
    by_domain: dict[str, Totals] = field(default_factory=dict)
    accept_num: list[float] = field(default_factory=list)
    accept_den: list[float] = field(default_factory=list)
    calib: list[tuple[float, float]] = field(default_factory=list)
    sampled_tau: list[float] = field(default_factory=list)

    def add(self, rec: FeedbackRecord, r: Replay) -> None:
        self.total.add(r)
        self.by_tenant.setdefault(rec.tenant_id, Totals()).add(r)
        self.by_domain.setdefault(rec.domain or UNTAGGED, Totals()).add(r)
        if len(self.accept_num) < len(r.accept_num):
            pad = len(r.accept_num) - len(self.accept_num)
            self.accept_num += [0.0] * pad
            self.accept_den += [0.0] * pad
        for i, (a, d) in enumerate(zip(r.accept_num, r.accept_den, strict=True)):
            self.accept_num[i] += a
            self.accept_den[i] += d
        self.calib += r.calib
        if r.expected_tau is not None:
            self.sampled_tau.append(r.expected_tau)

    def calibration(self) -> Calibration | None:
        if not self.calib:
            return None
        mae = sum(abs(p - o) for p, o in self.calib) / len(self.calib)
        bins = []
        for b in range(N_BINS):
            lo, hi = b / N_BINS, (b + 1) / N_BINS
            inside = [(p, o) for p, o in self.calib if lo <= p < hi or (b == N_BINS - 1 and p == 1.0)]
            if inside:
                bins.append(ReliabilityBin(lo=lo, hi=hi, predicted=_unit(sum(p for p, _ in inside) / len(inside)),
                                           observed=_unit(sum(o for _, o in inside) / len(inside)),
                                           count=len(inside)))
        return Calibration(mae=mae, bins=bins)

    def metrics(self, cost) -> DrafterMetrics:
        t = self.total
        tau = t.tau
        verify_per_round = t.verified / t.rounds if t.rounds else 1.0
        throughput = []
        for c in THROUGHPUT_CONCURRENCIES:
            step = cost.step_time(c, int(round(c * verify_per_round))) + c * cost.draft_per_request_s
            throughput.append(ThroughputPoint(concurrency=c, tokens_per_s=c * tau / step if step > 0 else 0.0))
        return DrafterMetrics(
            version=self.version, tau=tau,
            expected_tau_sampled=(sum(self.sampled_tau) / len(self.sampled_tau)) if self.sampled_tau else None,
            acceptance_by_position=[_unit(n / d) if d else 0.0 for n, d in zip(self.accept_num, self.accept_den,
                                                                              strict=True)],
            verified_per_accepted=t.verified / t.committed if t.committed else 0.0,
            calibration=self.calibration(), throughput=throughput)


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def _slices(cand: dict[str, Totals], champ: dict[str, Totals] | None) -> dict[str, SliceMetrics]:
    out = {}
    for key, t in sorted(cand.items()):
        champion_tau = champ[key].tau if champ and key in champ else 1.0
        out[key] = SliceMetrics(n_records=t.records, champion_tau=champion_tau, candidate_tau=t.tau)
    return out


def ar_throughput(cost) -> dict[int, float]:
    """Plain decoding at the same concurrencies (tau 1, one verified token, no drafter)."""
    return {c: c / cost.step_time(c, c) for c in THROUGHPUT_CONCURRENCIES}


# -- evaluation of one candidate -------------------------------------------------------------------------------
@dataclass
class ShadowResult:
    report: EvaluationReport
    skipped: int  # records of the window that could not be replayed (too short, too long)


def evaluate_drafters(target, tokenizer, records: Sequence[FeedbackRecord], candidate: tuple[str, object],
                      champion: tuple[str, object] | None, *, target_id: str, gamma: float, max_tokens: int,
                      cost=None, now: datetime | None = None, cache: dict | None = None) -> ShadowResult:
    """Replay ``records`` with the candidate (and the champion) and build the report.

    cache: replays kept across calls, keyed by (record id, drafter name, gamma, max_tokens);
    the evaluator passes one so the champion is not replayed again for every candidate
    (a name is a registry version, whose files never change).
    """
    from dataplane.cost_model import CostModel

    cost = cost or CostModel()
    drafters = [candidate] + ([champion] if champion else [])
    layers = sorted({int(x) for _, d in drafters for x in d.config.target_layers})
    aggs = {name: DrafterAggregate(version=name) for name, _ in drafters}
    used: list[FeedbackRecord] = []
    skipped = n_greedy = n_sampled = 0
    for rec in records:
        enc = encode_record(tokenizer, rec, max_tokens)
        if enc is None:
            skipped += 1
            continue
        ids, start = enc
        sampled = rec.sampling.temperature > 0
        keys = {name: (rec.record_id, name, gamma, max_tokens) for name, _ in drafters}
        todo = [(name, d) for name, d in drafters if cache is None or keys[name] not in cache]
        if todo:
            hidden, logits = target_pass(target, ids, layers, start if sampled else None)
        for name, d in drafters:
            if (name, d) in todo:
                cols = [layers.index(int(x)) for x in d.config.target_layers]
                rep = replay_drafter(d, hidden[:, cols], ids, start, gamma=gamma,
                                     temperature=rec.sampling.temperature, top_p=rec.sampling.top_p,
                                     target_logits=logits)
                if cache is not None:
                    cache[keys[name]] = rep
            else:
                rep = cache[keys[name]]
            aggs[name].add(rec, rep)
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
        per_tenant=_slices(cand.by_tenant, champ.by_tenant if champ else None),
        per_domain=_slices(cand.by_domain, champ.by_domain if champ else None))
    return ShadowResult(report=report, skipped=skipped)


# -- plots ------------------------------------------------------------------------------------------------------
def write_plots(report: EvaluationReport, directory: Path) -> dict[str, Path]:
    """tau per tenant and per domain, the reliability curve, acceptance by block position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    champ_name = f"champion {report.champion_version}" if report.champion_version else "plain decoding"
    for name, slices in (("tau_per_tenant", report.per_tenant), ("tau_per_domain", report.per_domain)):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        keys = list(slices) or ["(none)"]
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [slices[k].champion_tau if k in slices else 0 for k in keys], 0.4,
               label=champ_name)
        ax.bar([x + 0.2 for x in xs], [slices[k].candidate_tau if k in slices else 0 for k in keys], 0.4,
               label=f"candidate {report.candidate_version}")
        ax.set_xticks(list(xs), [f"{k}\n(n={slices[k].n_records})" if k in slices else k for k in keys], fontsize=8)
        ax.set_ylabel("tau (tokens per round)")
        ax.set_title(name.replace("_", " "))
        ax.legend(fontsize=8)
        fig.tight_layout()
        out[name] = directory / f"{name}.png"
        fig.savefig(out[name], dpi=80)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect")
    for label, m in (("candidate", report.candidate), ("champion", report.champion)):
        if m is not None and m.calibration is not None and m.calibration.bins:
            b = m.calibration.bins
            ax.plot([x.predicted for x in b], [x.observed for x in b], "o-",
                    label=f"{label} {m.version} (MAE {m.calibration.mae:.3f})")
    ax.set_xlabel("predicted accepted share (a_hat)")
    ax.set_ylabel("realised accepted share")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("length-head reliability")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["reliability"] = directory / "reliability.png"
    fig.savefig(out["reliability"], dpi=80)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, m in (("candidate", report.candidate), ("champion", report.champion)):
        if m is not None and m.acceptance_by_position:
            ax.plot(range(1, len(m.acceptance_by_position) + 1), m.acceptance_by_position, "o-",
                    label=f"{label} {m.version}")
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance by block position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out["acceptance_by_position"] = directory / "acceptance_by_position.png"
    fig.savefig(out["acceptance_by_position"], dpi=80)
    plt.close(fig)
    return out


# -- the worker ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    version: str
    state: str
    evaluation_id: int | None = None
    reason: str | None = None


class ShadowEvaluator:
    """Evaluates every version in state ``registered``: evaluating -> gates (or rejected).

    target / tokenizer / target_identity are loaded from the settings when not given.
    One evaluator per control plane; a version left ``evaluating`` by a crash is put
    back to ``registered`` by ``recover`` and evaluated again.
    """

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], registry: Registry,
                 policy: GatePolicy, window: FeedbackWindow | None = None, *, target=None, tokenizer=None,
                 target_identity: dict | None = None, cost=None, retry_s: float = 60.0):
        self.settings, self.sessions, self.registry, self.policy = settings, sessions, registry, policy
        self.window = window if window is not None else eval_window.persisted(window_from_settings(settings),
                                                                             sessions, settings)
        self._target, self._tokenizer, self._identity = target, tokenizer, target_identity
        self.cost = cost
        self.retry_s = retry_s
        self._retry_after: dict[str, float] = {}
        self._drafters: dict[tuple[str, str | None], object] = {}
        self._replays: dict = {}  # champion replays reused by the next candidate's evaluation
        self._deleted: dict = {}  # deletion cut-offs the cache was built under
        self._lock = threading.Lock()
        self.root = evaluations_dir(settings)

    # -- target and drafters --
    def _ensure_target(self) -> None:
        if self._target is not None and self._tokenizer is not None and self._identity is not None:
            return
        from dataplane.model import TargetModel
        from dataplane.target_cache import ensure_target, target_identity
        from dataplane.tokenizer import Tokenizer

        d = ensure_target(self.settings)
        self._identity = self._identity or target_identity(d)
        self._target = self._target or TargetModel.from_pretrained(d)
        self._tokenizer = self._tokenizer or Tokenizer(d)

    def _drafter(self, version: str, sha256: str | None):
        """Download (every file checked against the manifest), load and bind a version's drafter."""
        from dataplane.drafter_io import load_bundle

        key = (version, sha256)
        if key in self._drafters:
            return self._drafters[key]
        tmp = Path(tempfile.mkdtemp(prefix=f"adaflash-shadow-{version}-"))
        try:
            art = self.registry.download(version, tmp)
            if sha256 and art.manifest_sha256 != sha256:
                raise ArtifactIntegrityError(f"version {version}: manifest sha256 {art.manifest_sha256} differs "
                                             f"from the recorded {sha256}")
            drafter, _ = load_bundle(art.path, self._target, self._identity, expected_sha256=art.manifest_sha256)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if len(self._drafters) >= 4:
            self._drafters.pop(next(iter(self._drafters)))
        self._drafters[key] = drafter
        return drafter

    # -- the loop's steps --
    def recover(self) -> list[str]:
        """Versions left ``evaluating`` (a crash mid-evaluation) go back to ``registered``."""
        with session_scope(self.sessions) as s:
            stuck = s.scalars(select(Version).where(Version.state == VersionState.evaluating.value)).all()
            for v in stuck:
                for ev in s.scalars(select(Evaluation).where(Evaluation.version == v.version,
                                                             Evaluation.status == "running")):
                    ev.status, ev.error, ev.completed_at = "failed", "interrupted: control plane restarted", utcnow()
                lifecycle.transition(s, v, VersionState.registered, actor=SYSTEM_SHADOW,
                                     reason="evaluation interrupted; evaluating again")
            return [v.version for v in stuck]

    def pending(self) -> list[str]:
        now = time.monotonic()
        with self.sessions() as s:
            rows = s.scalars(select(Version.version).where(Version.state == VersionState.registered.value)
                             .order_by(Version.created_at, Version.version)).all()
        return [v for v in rows if self._retry_after.get(v, 0.0) <= now]

    def run_once(self) -> list[Outcome]:
        with self._lock:
            return [self.evaluate(v) for v in self.pending()]

    def evaluate(self, version: str) -> Outcome:
        with _tracer.start_as_current_span(Spans.SHADOW_EVALUATION) as span:
            span.set_attribute(SpanAttrs.VERSION, version)
            out = self._evaluate(version)
            span.set_attribute(SpanAttrs.DECISION, out.state)
            if out.evaluation_id is not None:
                span.set_attribute("evaluation_id", out.evaluation_id)
            return out

    def _refuse(self, version: str, evaluation_id: int | None, reason: str) -> Outcome:
        """An artifact that must never serve: the evaluation fails and the version is rejected."""
        with session_scope(self.sessions) as s:
            if evaluation_id is not None:
                ev = s.get(Evaluation, evaluation_id)
                ev.status, ev.error, ev.completed_at = "failed", reason, utcnow()
            v = lifecycle.get_version(s, version)
            lifecycle.transition(s, v, VersionState.rejected, actor=SYSTEM_SHADOW, reason=reason)
        log.warning("version %s refused: %s", version, reason)
        try:
            self.registry.set_state(version, VersionState.rejected.value)
        except Exception as e:  # mirrored again by the rollout loop
            log.warning("could not write the state of %s to MLflow: %s", version, e)
        return Outcome(version, VersionState.rejected.value, evaluation_id, reason)

    def _evaluate(self, version: str) -> Outcome:
        from dataplane.drafter_io import DrafterLoadError

        with session_scope(self.sessions) as s:
            v = lifecycle.get_version(s, version)
            if v.state != VersionState.registered.value:
                return Outcome(version, v.state)
            if v.manifest_sha256 is None:
                reason = f"artifact refused: {v.state_reason or 'manifest unreadable'}"
                lifecycle.transition(s, v, VersionState.rejected, actor=SYSTEM_SHADOW, reason=reason)
                return Outcome(version, VersionState.rejected.value, None, reason)
            ev = lifecycle.start_evaluation(s, version, actor=SYSTEM_SHADOW)
            ev_id, cand_sha = ev.id, v.manifest_sha256
            champion = ev.champion_version
            champ_sha = s.get(Version, champion).manifest_sha256 if champion else None
            ttls = {t.tenant_id: t.ttl_days for t in s.scalars(select(Tenant))}
            opted = [t.tenant_id for t in s.scalars(select(Tenant).where(Tenant.opt_out.is_(True)))]
            deleted = deletion.deleted_before(s)
        if deleted != self._deleted:
            # A tenant was deleted: replays cached from its records go (the cache is keyed by record id).
            self._replays.clear()
            self._deleted = deleted
        try:
            self._ensure_target()
            try:
                cand = self._drafter(version, cand_sha)
            except (ArtifactIntegrityError, DrafterLoadError) as e:
                return self._refuse(version, ev_id, f"artifact refused: {e}")
            champ = self._drafter(champion, champ_sha) if champion else None
            now = utcnow()
            records = select_window(self.window.read(), now=now, target_id=self.registry.target_id,
                                    tenant_ttl_days=ttls,
                                    default_ttl_days=self.settings.governance.default_ttl_days, opted_out=opted,
                                    max_records=self.settings.controlplane.shadow_max_records,
                                    deleted_before=deleted)
            max_tokens = min(self.settings.model.max_model_len, self.settings.learner.max_record_tokens)
            result = evaluate_drafters(self._target, self._tokenizer, records, (version, cand),
                                       (champion, champ) if champ is not None else None,
                                       target_id=self.registry.target_id, gamma=self.settings.dataplane.gamma,
                                       max_tokens=max_tokens, cost=self.cost, now=now, cache=self._replays)
            if len(self._replays) > 50_000:
                self._replays.clear()
            plots = self._store(ev_id, result.report)
        except Exception as e:  # broker, registry, disk: nothing said about the candidate; retried
            return self._failed(version, ev_id, f"{type(e).__name__}: {e}")
        with session_scope(self.sessions) as s:
            lifecycle.complete_evaluation(s, ev_id, result.report, plots, actor=SYSTEM_SHADOW)
        log.info("version %s evaluated on %d records (%d skipped): tau %.3f vs champion %s", version,
                 result.report.n_records, result.skipped, result.report.candidate.tau,
                 f"{result.report.champion.tau:.3f}" if result.report.champion else "none")
        return self.gate(version, ev_id)

    def gate(self, version: str, evaluation_id: int | None) -> Outcome:
        with _tracer.start_as_current_span(Spans.GATE) as span:
            span.set_attribute(SpanAttrs.VERSION, version)
            with session_scope(self.sessions) as s:
                results = lifecycle.apply_gates(s, version, evaluation_id, self.policy, now=utcnow(),
                                                default_ttl_days=self.settings.governance.default_ttl_days)
                state = lifecycle.get_version(s, version).state
                reason = lifecycle.get_version(s, version).state_reason
            span.set_attribute(SpanAttrs.DECISION, state)
        try:
            self.registry.set_gate_results(version, [r.to_dict() for r in results], self.policy.policy_version)
            self.registry.set_state(version, state)
        except Exception as e:  # MLflow down: tags are mirrored again later, the database decides
            log.warning("could not write gate results of %s to MLflow: %s", version, e)
        return Outcome(version, state, evaluation_id, reason)

    def _failed(self, version: str, evaluation_id: int, error: str) -> Outcome:
        """A crash that says nothing about the candidate: record it, retry later."""
        log.warning("evaluation %d of version %s failed: %s", evaluation_id, version, error)
        with session_scope(self.sessions) as s:
            ev = s.get(Evaluation, evaluation_id)
            ev.status, ev.error, ev.completed_at = "failed", error[:4000], utcnow()
            lifecycle.transition(s, lifecycle.get_version(s, version), VersionState.registered, actor=SYSTEM_SHADOW,
                                 reason=f"evaluation failed, retried later: {error[:500]}")
        self._retry_after[version] = time.monotonic() + self.retry_s
        return Outcome(version, VersionState.registered.value, evaluation_id, error)

    def _store(self, evaluation_id: int, report: EvaluationReport) -> dict[str, str]:
        d = self.root / str(evaluation_id)
        d.mkdir(parents=True, exist_ok=True)
        (d / "report.json").write_text(json.dumps(report.model_dump(mode="json"), indent=1))
        plots = write_plots(report, d)
        return {name: str(p.relative_to(self.root)) for name, p in plots.items()}

