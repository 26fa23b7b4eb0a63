"""Target supervision computed learner-side from scrubbed FeedbackRecords.

Token ids are not shipped (DESIGN.md): the learner re-tokenizes the scrubbed prompt
and response and runs the frozen target once over prompt + response with fresh caches. For every
position t it keeps

- ``ctx_hidden[t]``: the outputs of the target layers the drafter is conditioned on;
- ``final_hidden[t]``: the last layer's output (before the final norm);
- ``top1[t]``: the target's argmax for the token at t + 1.

The prompt is tokenized as the node tokenized it (a node ships chat requests with the
chat template already applied, completions as sent), or, with prompt_format "chat",
a prompt without special tokens is wrapped in the chat template as one user turn.

Full next-token distributions are not stored: at V = 49152 they would cost ~200 kB per
position (~60 MB per record). The final hidden state is stored instead (H floats per
position) and the exact full distribution is recomputed on demand by the frozen final
norm + LM head (``target_logits``), one small matmul per trained position. Nothing is
truncated to a top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash.contracts.feedback import FeedbackRecord
from dataplane.model import TargetModel
from dataplane.tokenizer import Tokenizer

# DLQ reasons (the ``reason`` header carries one of these, then ": detail").
BAD_SCHEMA = "bad_schema"
UNKNOWN_TARGET = "unknown_target"
TOO_LONG = "too_long"
TOO_SHORT = "too_short"


class Unusable(ValueError):
    """A record the learner cannot train on; ``reason`` is one of the DLQ reason codes."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Tokenized:
    record: FeedbackRecord
    ids: list[int]  # prompt (templated) + response
    prompt_len: int


@dataclass
class Supervised:
    record: FeedbackRecord
    tokens: torch.Tensor  # [L] int64
    prompt_len: int  # the response starts at this position
    ctx_hidden: torch.Tensor  # [L, n_target_layers, H]
    final_hidden: torch.Tensor  # [L, H]
    top1: torch.Tensor  # [L] int64, target argmax of the token after each position

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class Supervisor:
    """Re-tokenizes records and runs the frozen target for their supervision."""

    def __init__(self, target: TargetModel, tokenizer: Tokenizer, identity: dict, hidden_layers: list[int],
                 max_tokens: int = 1024, min_response_tokens: int = 2, chunk_tokens: int = 4096,
                 prompt_format: str = "as_sent"):
        self.target = target
        self.tok = tokenizer
        self.identity = identity
        self.hidden_layers = tuple(int(i) for i in hidden_layers)
        self.final_layer = target.args.num_layers - 1
        self.max_tokens = max_tokens
        self.min_response_tokens = min_response_tokens
        self.chunk_tokens = chunk_tokens
        self.prompt_format = prompt_format
        self._specials = [t for t in self.tok.hf.all_special_tokens if t]

    # --- checks and tokenization -------------------------------------------------------------
    def check_target(self, record: FeedbackRecord) -> None:
        t = record.target_model
        if t.id != self.identity["id"] or t.sha256 != self.identity["sha256"]:
            raise Unusable(UNKNOWN_TARGET, f"record is for {t.id} ({t.sha256[:12]}), this learner trains "
                                           f"for {self.identity['id']} ({self.identity['sha256'][:12]})")

    def prompt_ids(self, prompt_text: str) -> list[int]:
        """As sent, or (prompt_format "chat") a plain prompt wrapped in the chat template."""
        templated = any(s in prompt_text for s in self._specials)
        text = prompt_text if templated or self.prompt_format != "chat" else self.tok.apply_chat([{"role": "user", "content": prompt_text}])
        return self.tok.encode(text)

    def tokenize(self, record: FeedbackRecord) -> Tokenized:
        """Raises ``Unusable`` (unknown target, too long, too short)."""
        self.check_target(record)
        prompt = self.prompt_ids(record.prompt_text)
        response = self.tok.encode(record.response_text)
        total = len(prompt) + len(response)
        if total > self.max_tokens:
            raise Unusable(TOO_LONG, f"{total} tokens > max_record_tokens {self.max_tokens}")
        if len(response) < self.min_response_tokens:
            raise Unusable(TOO_SHORT, f"{len(response)} response tokens < {self.min_response_tokens}")
        return Tokenized(record, prompt + response, len(prompt))

    # --- the target pass ------------------------------------------------------------------------
    def supervise(self, items: list[Tokenized]) -> list[Supervised]:
        """Run the target over the records, packed into streams of at most chunk_tokens."""
        out: list[Supervised] = []
        group: list[Tokenized] = []
        for it in items:
            if group and sum(len(g.ids) for g in group) + len(it.ids) > self.chunk_tokens:
                out += self._run(group)
                group = []
            group.append(it)
        if group:
            out += self._run(group)
        return out

    def _run(self, group: list[Tokenized]) -> list[Supervised]:
        ids = torch.tensor([t for g in group for t in g.ids], dtype=torch.int64, device=self.target.lm_head.weight.device)
        cu = [0]
        for g in group:
            cu.append(cu[-1] + len(g.ids))
        kvs = [self.target.new_cache(len(g.ids)) for g in group]
        layers = self.hidden_layers + (self.final_layer,)
        res = self.target.forward_packed(ids, cu, kvs, logits_index=torch.empty(0, dtype=torch.int64),
                                         hidden_layers=layers)
        hidden = res.hidden.clone()  # out of inference mode: the drafter trains on it
        out = []
        for b, g in enumerate(group):
            h = hidden[cu[b]:cu[b + 1]]
            final = h[:, -1].contiguous()
            top1 = torch.cat([self.target_logits(final[i:i + 256]).argmax(-1) for i in range(0, h.shape[0], 256)])
            out.append(Supervised(g.record, ids[cu[b]:cu[b + 1]].clone(), g.prompt_len,
                                  h[:, :-1].contiguous(), final, top1))
        return out

    @torch.no_grad()
    def target_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Exact target logits from stored final hidden states: [M, H] -> [M, V]."""
        return self.target.lm_head(self.target.model.norm(final_hidden))
