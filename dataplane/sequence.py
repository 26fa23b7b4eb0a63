"""One request's state inside the engine: what decoding needs, nothing else.

The request's text, domain, trace and token callback travel beside it in its
``dataplane.envelope.RequestEnvelope``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dataplane.kv_cache import SeqKV
from dataplane.spec_policy import RequestState


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # with temperature > 0: position-keyed draws (dataplane.sampling)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and its k top alternatives
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already emitted
    frequency_penalty: float = 0.0  # ... times the number of times it was emitted
    grammar: object | None = None  # xgrammar CompiledGrammar of the response_format (dataplane.grammar)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Round:
    k_hat: int
    accepted: int
    a_hat: float


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant_id: str = "default"  # admission key: fair share, quotas, per-tenant metrics

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    target_kv: SeqKV | None = None
    drafter_kv: SeqKV | None = None
    drafter_version: str | None = None  # drafter whose context cache this sequence holds
    # Target hidden states [n, layers, H] of committed positions not yet in drafter_kv: the
    # drafter's context is extended only when it next drafts for this request, so a step
    # that does not draft costs what an ar step costs.
    context_pending: list[torch.Tensor] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy: RequestState = field(default_factory=RequestState)  # speculation policy state (spec_policy)
    generator: torch.Generator | None = None
    grammar_state: object | None = None  # dataplane.grammar.GrammarState, engine thread only
    logprobs: list = field(default_factory=list)  # dataplane.sampling.TokenLogprob per output token
    arrival: float = field(default_factory=time.monotonic)
    prefill_at: float | None = None  # admitted: prefill started
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0.0

    @property
    def constrained(self) -> bool:
        """Verified on its own rows: a grammar or a penalty changes its target distribution."""
        p = self.params
        return self.grammar_state is not None or bool(p.presence_penalty or p.frequency_penalty)

    @property
    def seeded(self) -> bool:
        """Sampled with position-keyed noise: verified like greedy on perturbed scores."""
        return not self.greedy and self.params.seed is not None

    def stats(self) -> dict:
        rounds = self.rounds
        acc = sum(r.accepted for r in rounds)
        ver = sum(r.k_hat for r in rounds)
        return {
            "rounds": len(rounds),
            "draft_tokens": sum(r.k_hat - 1 for r in rounds),
            "verified_tokens": ver,
            "accepted_tokens": acc,
            "mean_accept_len": (acc + len(rounds)) / len(rounds) if rounds else 0.0,
            "mean_verify_len": ver / len(rounds) if rounds else 0.0,
        }
