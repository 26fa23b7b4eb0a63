"""Per-request token choice and target log-probabilities, shared by prefill and verification.

Three ways a request's tokens are chosen, each applied to the target's logits after the
request's presence/frequency penalties and grammar mask (``dataplane.grammar``):

- greedy (temperature 0): argmax.
- seeded sampling (temperature > 0 and a ``seed``): position-keyed Gumbel-max. The token
  at output position i is argmax(log p_i + G_i), where p_i is the processed target
  distribution there (temperature, top-p) and G_i is Gumbel noise drawn from a generator
  seeded by (seed, i) alone. Each token is an exact sample from p_i, and the noise does
  not depend on the batch, the mode or how many tokens were drafted, so the same seed gives
  the same text in ar, fixed and adaptive. Verification is greedy on the perturbed scores
  (a draft is kept iff it is the token the target would have drawn), and the drafter
  drafts with the same noise, which couples its guesses to the target's draws.
- unseeded sampling: rejection sampling (``dataplane.verify``) with the request's own
  generator; lossless, and accepts more drafts, but the draws depend on drafting.

Log-probabilities are always those of the raw target distribution (temperature 1, before
penalties and the grammar mask), as vLLM and SGLang report by default, and are computed one row at a
time so that a token's numbers do not depend on how many rows the step had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dataplane.verify import process_logits

_MASK64 = (1 << 64) - 1
# Sub-stream of choice i > 0 of an n > 1 request (choice 0 keeps the request's seed).
CHOICE_STREAM = 1 << 40


def mix_seed(seed: int, stream: int) -> int:
    """A 63-bit seed for ``stream`` (position or choice) of ``seed`` (splitmix64 finaliser)."""
    z = ((seed & _MASK64) + (stream + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[V] float32 Gumbel(0, 1) noise of one output position of a seeded request."""
    g = torch.Generator().manual_seed(mix_seed(seed, position))
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def seeded_scores(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int) -> torch.Tensor:
    """Perturbed scores of one row: argmax is a sample of the processed distribution.

    Args:
        logits: [V] target (or drafter, expanded to V) logits, grammar mask applied.
    Returns:
        [V] float32 log p + G (-inf where p is 0).
    """
    p = process_logits(logits.unsqueeze(0), temperature, top_p)[0]
    return torch.log(p) + gumbel_noise(seed, position, logits.shape[-1]).to(p.device)


def seeded_draft(q: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """Drafts of a seeded request from processed draft probabilities q [n, V]: row j is the
    drafter's Gumbel-max draw at output position first_position + j, with the target's
    noise. Returns [n] int64 target token ids."""
    rows = [torch.log(q[j].float()) + gumbel_noise(seed, first_position + j, q.shape[-1]).to(q.device)
            for j in range(q.shape[0])]
    return torch.stack(rows).argmax(-1)


def grammar_drafts(seq, q: torch.Tensor) -> torch.Tensor:
    """Drafts of a greedy or seeded request with a grammar: the drafter's choice among the
    tokens the grammar allows (with the target's position noise when seeded), so structural
    tokens the grammar forces are drafted right.

    Args:
        q: [n, V] processed draft probabilities in the target vocabulary.
    Returns:
        [n] int64 target token ids.
    """
    scores = torch.log(q.float())
    if seq.seeded:
        pos = len(seq.output_ids)
        noise = [gumbel_noise(seq.params.seed, pos + j, q.shape[-1]) for j in range(q.shape[0])]
        scores = scores + torch.stack(noise).to(q.device)
    return torch.tensor(seq.grammar_state.draft(scores), dtype=torch.int64)


@dataclass
class TokenLogprob:
    """One emitted token: its log-probability under the target and the top alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Target log-probabilities of emitted tokens.

    Args:
        logits: [m, V] raw target logits, row j the distribution token j was chosen from.
        tokens: m emitted token ids.
        top: how many most likely alternatives to report per position (0..20).
    Returns:
        m TokenLogprob, alternatives in descending order.
    """
    out = []
    for j, tok in enumerate(tokens):
        lp = torch.log_softmax(logits[j].float().unsqueeze(0), dim=-1)[0]
        alts: list[tuple[int, float]] = []
        if top > 0:
            vals, idx = lp.topk(top)
            alts = list(zip(idx.tolist(), vals.tolist(), strict=True))
        out.append(TokenLogprob(token=tok, logprob=float(lp[tok]), top=alts))
    return out


def penalised(seq, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties along a draft.

    Row j follows the committed output plus drafts[:j], so its counts include those drafts:
    where every earlier draft is accepted they are exactly the tokens ``ar`` would have
    emitted, which keeps speculation lossless against the penalised distribution.

    Args:
        rows: [m, V] logits; drafts: the m - 1 draft tokens.
    Returns:
        [m, V] float32 copy: logit - frequency * count - presence * (count > 0).
    """
    p = seq.params
    ids = torch.tensor(seq.output_ids, dtype=torch.int64, device=rows.device)
    counts = torch.bincount(ids, minlength=rows.shape[-1]).float()
    out = rows.float().clone()
    for j in range(rows.shape[0]):
        if j > 0:
            counts[drafts[j - 1]] += 1.0
        out[j] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def constrained_rows(seq, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """The rows a request is verified on: penalised, grammar-masked, then for a seeded
    request its perturbed scores (verified by argmax like greedy).

    Args:
        seq: the request (``dataplane.sequence.Sequence``); its next output position is
            len(seq.output_ids), which row 0 predicts.
        rows: [m, V] raw target logits of the request's segment.
        drafts: its m - 1 draft tokens.
    Returns:
        [m, V] float32 (``rows`` itself when nothing applies).
    """
    if seq.params.presence_penalty or seq.params.frequency_penalty:
        rows = penalised(seq, rows, drafts)
    if seq.grammar_state is not None:
        rows = seq.grammar_state.masked(rows, drafts)
    if seq.seeded:
        p, pos = seq.params, len(seq.output_ids)
        rows = torch.stack([seeded_scores(rows[j], p.temperature, p.top_p, p.seed, pos + j)
                            for j in range(rows.shape[0])])
    return rows


def first_token(seq, row: torch.Tensor) -> int:
    """The token a request emits after its prompt, from the prefill's last row [V]."""
    rows = constrained_rows(seq, row.unsqueeze(0), [])
    if seq.greedy or seq.seeded:
        return int(rows[0].argmax())
    p = process_logits(rows[0], seq.params.temperature, seq.params.top_p)
    if seq.generator is not None:
        p = p.to(seq.generator.device)
    return int(torch.multinomial(p, 1, generator=seq.generator))
