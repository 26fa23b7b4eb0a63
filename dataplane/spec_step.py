"""One decode step for every selected request: draft, choose k_hat, pack, verify, commit.

    drafter forward (one pass, all drafting requests)  -> block hidden h [B, k, H]
    length head                                        -> a_hat [B] -> k_hat [B]
    (lengths and back-off: dataplane.spec_policy; the batch was chosen before drafting)
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

from dataplane import spec_policy as sp
from dataplane.cost_model import CostModel
from dataplane.drafter import Drafter
from dataplane.kernels import greedy_accept, pack_drafts
from dataplane.model import TargetModel
from dataplane.sampling import constrained_rows, grammar_drafts, seeded_draft
from dataplane.sequence import Round, Sequence
from dataplane.verify import process_logits, request_uniforms, sample_draft_tokens, verify, verify_sampling


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
    """Runs what ``dataplane.spec_policy`` decides: it holds the node's policy state and
    cost curve, and no rule of its own."""

    def __init__(self, target: TargetModel, policy: sp.PolicyConfig, cost: CostModel):
        self.target = target
        self.policy = policy
        self.mode = policy.mode
        self.k = policy.block_size
        self.cost = cost
        self.node = sp.NodeState()

    def reset_calibration(self) -> None:
        """A new drafter (and head): trust its head again and re-learn quickly."""
        self.node.reset()

    # --- planning ---------------------------------------------------------------------------
    def caps(self, seq: Sequence, max_len: int) -> int:
        """Most tokens this request may verify: block size, tokens left, context left."""
        left = seq.params.max_tokens - len(seq.output_ids)
        ctx_left = max_len - seq.num_tokens
        return max(1, min(self.k, left, ctx_left))

    def reserve(self, seqs: list[Sequence], drafter: Drafter | None, version: str | None,
                max_len: int) -> list[int]:
        """Before the drafter runs: the most tokens each request may verify this step."""
        if drafter is None:
            return [1] * len(seqs)
        return sp.reserve([s.policy for s in seqs], [self.caps(s, max_len) for s in seqs],
                          [s.drafter_version == version for s in seqs], self.policy, self.node, self.cost)

    def plan(self, seqs: list[Sequence], reserved: list[int], drafter: Drafter | None) -> StepPlan:
        """Draft for the requests the scheduler chose with a reservation above one token."""
        B = len(seqs)
        k_hat = [1] * B
        a_hat = [0.0] * B
        drafts = torch.zeros(B, max(self.k - 1, 1), dtype=torch.int64)
        probs: list[torch.Tensor | None] = [None] * B
        t0 = time.perf_counter()
        idx = [i for i, r in enumerate(reserved) if r > 1]
        if idx and drafter is not None:
            self._draft(seqs, idx, [reserved[i] for i in idx], drafter, k_hat, a_hat, drafts, probs)
        draft_s = time.perf_counter() - t0
        if idx and drafter is not None:
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

    def _draft(self, seqs, idx, reserved, drafter, k_hat, a_hat, drafts, probs) -> None:
        sub = [seqs[i] for i in idx]
        self.catch_up(drafter, sub)
        last = torch.tensor([s.last_token for s in sub], dtype=torch.int64)
        h = drafter.forward_block(last, [s.drafter_kv for s in sub])  # [Bd, k, H]
        with torch.inference_mode():
            ah = drafter.length_head(h).float().tolist()  # [Bd]
        kh, paid = sp.choose([s.policy for s in sub], ah, reserved, len(seqs), self.policy, self.node, self.cost)
        sp.after_pass(self.policy, self.node, paid)
        for j, i in enumerate(idx):
            a_hat[i] = ah[j]
        n = max(kh)
        if n <= 1:
            return
        with torch.inference_mode():
            logits = drafter.logits(h[:, 1:n])  # [Bd, n-1, Vd]
        for j, i in enumerate(idx):
            s, kj = sub[j], kh[j]
            k_hat[i] = kj
            if kj > 1:
                self._fill_drafts(s, drafter, logits[j, : kj - 1], drafts[i, : kj - 1], probs, i)

    @staticmethod
    def _fill_drafts(s: Sequence, drafter: Drafter, logits: torch.Tensor, out: torch.Tensor,
                     probs: list, i: int) -> None:
        """The request's draft tokens from the drafter's logits [m, Vd], as its sampling asks."""
        if s.grammar_state is not None and (s.greedy or s.seeded):  # drafts the grammar allows
            temp, top_p = (s.params.temperature, s.params.top_p) if s.seeded else (1.0, 1.0)
            out[:] = grammar_drafts(s, drafter.expand_probs(process_logits(logits, temp, top_p)))
        elif s.greedy:
            out[:] = drafter.to_target_ids(logits.argmax(-1))
        elif s.seeded:  # the target's position noise: drafts are verified by equality
            q = drafter.expand_probs(process_logits(logits, s.params.temperature, s.params.top_p))
            out[:] = seeded_draft(q, s.params.seed, len(s.output_ids))
        else:
            q = process_logits(logits, s.params.temperature, s.params.top_p)
            out[:] = drafter.to_target_ids(sample_draft_tokens(q, s.generator))
            full = drafter.expand_probs(q)
            probs[i] = torch.cat([full, full.new_zeros(1, full.shape[-1])])  # row k_hat-1 unused

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
        sp.calibrate(self.node, list(zip(plan.k_hat, plan.a_hat, accepted, strict=True)), self.policy)
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

    def record_round(self, seq: Sequence, k_hat: int, accepted: int, a_hat: float, batch: int = 1) -> None:
        seq.rounds.append(Round(k_hat=k_hat, accepted=accepted, a_hat=a_hat))
        sp.observe(seq.policy, k_hat, accepted, self.policy, self.node, self.cost, batch)
