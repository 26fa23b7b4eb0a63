"""The DB-backed shadow evaluator: every registered version is replayed, stored and gated.

The worker stores the report (EvaluationReport JSON) and PNG plots under the evaluations
directory, links them from the evaluations table, then applies the gates. The replay
runs the node's speculation policy (``dataplane.spec_policy``, from the dataplane
configuration) priced by the newest cost curve a node measured and reported.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from adaflash.config import Settings
from adaflash.contracts.evaluation import EvaluationReport
from adaflash.telemetry import CONTROLPLANE, SpanAttrs, Spans, tracer
from controlplane import deletion, eval_window, fleet, lifecycle
from controlplane.db import session_scope, utcnow
from controlplane.gates import GatePolicy
from controlplane.models import Evaluation, Tenant, Version
from controlplane.registry import ArtifactIntegrityError, Registry
from controlplane.shadow.aggregate import evaluate_drafters
from controlplane.shadow.plots import write_plots
from controlplane.shadow.store import evaluations_dir
from controlplane.shadow.window import FeedbackWindow, select_window, window_from_settings
from controlplane.states import VersionState
from dataplane.spec_policy import PolicyConfig

log = logging.getLogger("adaflash.controlplane.shadow")
_tracer = tracer(__name__, service=CONTROLPLANE)

SYSTEM_SHADOW = "system:shadow"


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
        from dataplane.runner import ModelRunner
        from dataplane.target_cache import ensure_target, target_identity
        from dataplane.tokenizer import Tokenizer

        d = ensure_target(self.settings)
        self._identity = self._identity or target_identity(d)
        # replayed as nodes serve it: the precision they serve in on this machine, so the
        # replay's greedy acceptance is the one they realise
        self._target = self._target or ModelRunner.serving(self.settings).load_target(d)
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

    def _cost_curve(self):
        """The cost curve that prices the replay: the one given, else the newest measured
        curve a node sent in its heartbeat, else the cost model's priors."""
        from dataplane.cost_model import CostModel

        if self.cost is not None:
            return self.cost, "given"
        with self.sessions() as s:
            latest = fleet.latest_cost_curve(s)
        if latest is None:
            return CostModel(), "priors"
        node_id, curve = latest
        return CostModel.from_snapshot(curve), f"node:{node_id}"

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
            cost, source = self._cost_curve()
            result = evaluate_drafters(self._target, self._tokenizer, records, (version, cand),
                                       (champion, champ) if champ is not None else None,
                                       target_id=self.registry.target_id,
                                       policy=PolicyConfig.of(self.settings.dataplane), max_tokens=max_tokens,
                                       cost=cost, cost_source=source, now=now, cache=self._replays)
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
