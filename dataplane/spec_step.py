"""One decode step for every selected request: draft, choose k_hat, pack, verify, commit.

    drafter forward (one pass, all drafting requests)  -> block hidden h [B, k, H]
    length head                                        -> a_hat [B] -> k_hat [B]
    draft logits for positions 1..max(k_hat)-1         -> draft tokens (argmax or sampled)
    pack [last token, drafts[:k_hat-1]] per request    -> flat stream of sum(k_hat) tokens
    one target forward over the stream                 -> logits [T, V], hidden [T, n, H]
    verify (greedy or rejection sampling)              -> accepted [B], bonus [B]
    commit accepted + bonus, truncate rejected KV, extend the drafter's context

``ar`` mode is the same step with k_hat = 1 and no drafter, so the baseline shares every
line of the serving path with the speculative modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dataplane.cost_model import CostModel
from dataplane.drafter import Drafter, k_hat_from
from dataplane.kernels import greedy_accept, pack_drafts
from dataplane.model import TargetModel
from dataplane.sampling import constrained_rows, grammar_drafts, seeded_draft
from dataplane.sequence import Round, Sequence
from dataplane.verify import process_logits, request_uniforms, sample_draft_tokens, verify, verify_sampling

MAX_BACKOFF = 16


@dataclass
class StepPlan:
    seqs: list[Sequence]
    k_hat: list[int]
    a_hat: list[float]
    drafts: torch.Tensor  # [B, K-1] int64 (padding where k_hat is smaller)
    draft_probs: list[torch.Tensor | None]  # per request [k_hat, V] for sampled requests
    draft_s: float


@dataclass
class StepResult:
    committed: list[list[int]]  # tokens each request commits (before stop handling)
    accepted: list[int]
    verify_tokens: int
    verify_s: float
    logits: torch.Tensor | None = None  # [T, V] raw target logits of the verify stream


class SpecStep:
    def __init__(self, target: TargetModel, mode: str, block_size: int, gamma: float, cost: CostModel,
                 breakeven: bool = True):
        self.target = target
        self.mode = mode
        self.k = block_size
        self.gamma = gamma
        self.cost = cost
        self.breakeven = breakeven
        self.calib = 1.0  # EMA of realised / predicted acceptance, node-wide
        self.calib_rounds = 0  # steps that fed it since the drafter was set
        # Node-wide back-off (adaptive + breakeven): a drafter pass that paid for no request
        # (every request's gain below 1) was pure cost; skip the drafter for this many steps
        # (doubling up to MAX_BACKOFF while passes stay useless, reset by a useful one).
        self.node_skip = 0
        self.node_backoff = 1
        self.pass_paid = False  # set by _breakeven: drafting paid for some request this step

    def reset_calibration(self) -> None:
        """A new drafter (and head): trust its head again and re-learn quickly."""
        self.calib, self.calib_rounds = 1.0, 0
        self.node_skip, self.node_backoff = 0, 1

    # --- planning ---------------------------------------------------------------------------
    def caps(self, seq: Sequence, max_len: int) -> int:
        """Most tokens this request may verify: block size, tokens left, context left."""
        left = seq.params.max_tokens - len(seq.output_ids)
        ctx_left = max_len - seq.num_tokens
        return max(1, min(self.k, left, ctx_left))

    def plan(self, seqs: list[Sequence], drafter: Drafter | None, version: str | None, max_len: int) -> StepPlan:
        B = len(seqs)
        k_hat = [1] * B
        a_hat = [0.0] * B
        drafts = torch.zeros(B, max(self.k - 1, 1), dtype=torch.int64)
        probs: list[torch.Tensor | None] = [None] * B
        t0 = time.perf_counter()
        if self.mode != "ar" and drafter is not None:
            idx = [i for i, s in enumerate(seqs) if s.drafter_version == version and s.skip_rounds == 0
                   and self.caps(s, max_len) > 1]
            for s in seqs:
                s.skip_rounds = max(0, s.skip_rounds - 1)
            node_backs_off = self.mode == "adaptive" and self.breakeven
            if node_backs_off and self.node_skip > 0:
                self.node_skip -= 1
                idx = []
            if idx:
                self._draft(seqs, idx, drafter, k_hat, a_hat, drafts, probs, max_len)
                if node_backs_off:
                    if self.pass_paid:
                        self.node_backoff = 1
                    else:
                        self.node_skip = self.node_backoff
                        self.node_backoff = min(MAX_BACKOFF, 2 * self.node_backoff)
        draft_s = time.perf_counter() - t0
        if self.mode != "ar" and drafter is not None:
            self.cost.observe_draft(sum(1 for k in k_hat if k > 1), draft_s)
        return StepPlan(seqs, k_hat, a_hat, drafts, probs, draft_s)

    @staticmethod
    def catch_up(drafter: Drafter, seqs: list[Sequence]) -> None:
        """Extend each request's drafter context by the positions committed since it last drafted."""
        rows, cu, kvs = [], [0], []
        for s in seqs:
            if s.context_pending:
                rows.extend(s.context_pending)
                cu.append(cu[-1] + sum(r.shape[0] for r in s.context_pending))
                kvs.append(s.drafter_kv)
                s.context_pending = []
        if kvs:
            drafter.extend_context(torch.cat(rows), cu, kvs)

    def _draft(self, seqs, idx, drafter, k_hat, a_hat, drafts, probs, max_len) -> None:
        sub = [seqs[i] for i in idx]
        self.catch_up(drafter, sub)
        last = torch.tensor([s.last_token for s in sub], dtype=torch.int64)
        h = drafter.forward_block(last, [s.drafter_kv for s in sub])  # [Bd, k, H]
        with torch.inference_mode():
            ah = drafter.length_head(h).float()  # [Bd]
        caps = torch.tensor([self.caps(s, max_len) for s in sub])
        if self.mode == "fixed":
            kh = caps.clone()
        elif self.breakeven:
            kh = self._breakeven(sub, ah, caps, len(seqs))
        else:
            kh = torch.minimum(k_hat_from(ah, self.k, self.gamma), caps)
        n = int(kh.max())
        if n <= 1:
            for j, i in enumerate(idx):
                a_hat[i] = float(ah[j])
            return
        with torch.inference_mode():
            logits = drafter.logits(h[:, 1:n])  # [Bd, n-1, Vd]
        for j, i in enumerate(idx):
            s, kj = sub[j], int(kh[j])
            k_hat[i], a_hat[i] = kj, float(ah[j])
            if kj <= 1:
                continue
            if s.grammar_state is not None and (s.greedy or s.seeded):  # drafts the grammar allows
                temp, top_p = (s.params.temperature, s.params.top_p) if s.seeded else (1.0, 1.0)
                q = drafter.expand_probs(process_logits(logits[j, : kj - 1], temp, top_p))
                drafts[i, : kj - 1] = grammar_drafts(s, q)
            elif s.greedy:
                drafts[i, : kj - 1] = drafter.to_target_ids(logits[j, : kj - 1].argmax(-1))
            elif s.seeded:  # the target's position noise: drafts are verified by equality
                q = drafter.expand_probs(process_logits(logits[j, : kj - 1], s.params.temperature, s.params.top_p))
                drafts[i, : kj - 1] = seeded_draft(q, s.params.seed, len(s.output_ids))
            else:
                q = process_logits(logits[j, : kj - 1], s.params.temperature, s.params.top_p)
                tok = sample_draft_tokens(q, s.generator)
                drafts[i, : kj - 1] = drafter.to_target_ids(tok)
                full = drafter.expand_probs(q)
                probs[i] = torch.cat([full, full.new_zeros(1, full.shape[-1])])  # row k_hat-1 unused

    def _breakeven(self, sub: list[Sequence], ah: torch.Tensor, caps: torch.Tensor, batch: int) -> torch.Tensor:
        """Cost-aware verified length (``breakeven``): instead of the paper's k_hat alone, the
        m in 1..cap that maximises expected tokens per unit of the node's measured step
        time (m = 1 is plain decoding; see ``CostModel.best_length``).

        The per-position acceptance p comes from gamma * a_hat (calibrated node-wide),
        blended with the request's own recent rounds (geometric estimate: accepted drafts
        over accepted drafts + rejections). Where even the best m does not pay for the
        drafter's share, the request stops drafting for a few rounds (back-off doubling
        up to MAX_BACKOFF, reset by a good round); this round's draft is already paid for.
        """
        out = caps.clone()
        self.pass_paid = False
        for j, s in enumerate(sub):
            p = min(0.98, CostModel.position_accept(self.gamma * float(ah[j]), self.k) * self.calib)
            recent = [r for r in s.rounds[-4:] if r.k_hat > 1]
            if recent:
                acc = sum(r.accepted for r in recent)
                rejections = sum(1 for r in recent if r.accepted < r.k_hat - 1)
                if acc + rejections:
                    p = 0.5 * p + 0.5 * acc / (acc + rejections)
            m, gain = self.cost.best_length(p, int(caps[j]), batch)
            out[j] = m
            self.pass_paid |= gain >= 1.0
            if gain < 1.0:
                s.skip_rounds = s.backoff
                s.backoff = min(MAX_BACKOFF, s.backoff * 2)
        return out

    # --- verification -----------------------------------------------------------------------
    def run(self, plan: StepPlan, hidden_layers: tuple[int, ...]) -> tuple[StepResult, torch.Tensor | None,
                                                                         list[int]]:
        """Verify the plan. Returns the result, target hidden [T, n, H] (or None) and cu_seqlens."""
        seqs = plan.seqs
        kh = torch.tensor(plan.k_hat, dtype=torch.int64)
        last = torch.tensor([s.last_token for s in seqs], dtype=torch.int64)
        seq_lens = torch.tensor([s.target_kv.length for s in seqs], dtype=torch.int64)
        token_ids, _positions, cu = pack_drafts(last, plan.drafts, kh, seq_lens)
        cu_list = cu.tolist()
        t0 = time.perf_counter()
        out = self.target.forward_packed(token_ids, cu_list, [s.target_kv for s in seqs],
                                         hidden_layers=hidden_layers)
        accepted, bonus = self._verify(seqs, plan, out.logits, token_ids, cu)
        verify_s = time.perf_counter() - t0
        self.cost.observe_verify(len(seqs), int(token_ids.numel()), verify_s)
        committed = []
        tok = token_ids.tolist()
        for b in range(len(seqs)):
            s = cu_list[b]
            committed.append(tok[s + 1 : s + 1 + accepted[b]] + [bonus[b]])
        self._update_calibration(plan, accepted)
        return StepResult(committed, accepted, int(token_ids.numel()), verify_s, out.logits), out.hidden, cu_list

    def _verify(self, seqs, plan, logits, token_ids, cu) -> tuple[list[int], list[int]]:
        """Plain greedy requests are verified together on the raw logits; a request with a
        grammar, penalties or a seed on its own rows (``constrained_rows``), by argmax when
        greedy or seeded; sampled requests together by rejection sampling (``_verify_sampled``)."""
        B = len(seqs)
        plain = [i for i, s in enumerate(seqs) if s.greedy and not s.constrained]
        accepted, bonus = [0] * B, [0] * B
        if len(plain) == B:
            res = verify(logits, token_ids, cu, torch.zeros(B))
            return res.accepted.tolist(), res.bonus.tolist()
        if plain:
            res = verify(logits, token_ids, cu, torch.zeros(B))
            for i in plain:
                accepted[i], bonus[i] = int(res.accepted[i]), int(res.bonus[i])
        sampled = []
        for i, s in enumerate(seqs):
            if s.greedy and not s.constrained:
                continue
            if not (s.greedy or s.seeded):
                sampled.append(i)
                continue
            a, e = int(cu[i]), int(cu[i + 1])
            rows = constrained_rows(s, logits[a:e], token_ids[a + 1 : e].tolist())
            acc, bon = greedy_accept(rows, token_ids[a:e], torch.tensor([0, e - a]))
            accepted[i], bonus[i] = int(acc[0]), int(bon[0])
        if sampled:
            spans = [(int(cu[i]), int(cu[i + 1])) for i in sampled]
            acc, bon = self._verify_sampled([seqs[i] for i in sampled], [plan.draft_probs[i] for i in sampled],
                                            spans, logits, token_ids)
            for j, i in enumerate(sampled):
                accepted[i], bonus[i] = acc[j], bon[j]
        return accepted, bonus

    @staticmethod
    def _verify_sampled(seqs: list[Sequence], probs: list[torch.Tensor | None], spans: list[tuple[int, int]],
                        logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rejection-sample the segments ``spans`` (rows [a, e) of the stream) of sampled
        requests in one call: their rows (``constrained_rows``: penalties, grammar) and draft
        distributions [e - a, V] are packed into a sub-stream, and each request draws its
        uniforms from its own generator, as it would verified alone."""
        rows, q, ids, cu = [], [], [], [0]
        for s, p, (a, e) in zip(seqs, probs, spans, strict=True):
            rows.append(constrained_rows(s, logits[a:e], token_ids[a + 1 : e].tolist()).float())
            q.append(p.float() if p is not None else logits.new_zeros(e - a, logits.shape[-1], dtype=torch.float32))
            ids.append(token_ids[a:e])
            cu.append(cu[-1] + e - a)
        stream_rows = torch.cat(rows)
        u = request_uniforms([e - a for a, e in spans], [s.generator for s in seqs], stream_rows.device)
        r = verify_sampling(stream_rows, torch.cat(q).to(stream_rows.device), torch.cat(ids), torch.tensor(cu),
                            torch.tensor([s.params.temperature for s in seqs]),
                            torch.tensor([s.params.top_p for s in seqs]), uniforms=u)
        return r.accepted.tolist(), r.bonus.tolist()

    def _update_calibration(self, plan: StepPlan, accepted: list[int]) -> None:
        """EMA of realised / predicted accepted drafts over the rounds that drafted.

        The first steps after a drafter is set average with weight 1/n (a bias-corrected
        start), so a head that over- or under-predicts is corrected within a few steps
        rather than the EMA's ~20; later steps weigh 0.05.
        """
        pred = real = 0.0
        for k, a_hat, acc in zip(plan.k_hat, plan.a_hat, accepted, strict=True):
            if k > 1:
                pred += CostModel.expected_accepted(CostModel.position_accept(self.gamma * a_hat, self.k), k - 1)
                real += acc
        if pred > 0:
            self.calib_rounds += 1
            w = max(0.05, 1.0 / self.calib_rounds)
            self.calib = min(4.0, max(0.05, (1.0 - w) * self.calib + w * (real / pred)))

    @staticmethod
    def record_round(seq: Sequence, k_hat: int, accepted: int, a_hat: float) -> None:
        seq.rounds.append(Round(k_hat=k_hat, accepted=accepted, a_hat=a_hat))
        if k_hat > 1 and accepted >= (k_hat - 1) / 2:
            seq.backoff = 1
