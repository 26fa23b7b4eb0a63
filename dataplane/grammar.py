"""Grammar-constrained decoding (``response_format``) with xgrammar.

The server compiles a request's ``response_format`` once (``GrammarCompiler.compile``,
cached per schema) against the target's tokenizer; the engine gives each sequence a
``GrammarState`` (an xgrammar matcher) and, at every verified position, masks the target's
logits with the tokens the grammar allows after the committed text plus the drafts before
that position. A draft token the grammar forbids therefore has target probability 0 and
is rejected, and acceptance is computed against the masked distribution: constrained
output in fixed/adaptive equals constrained ``ar``.
"""

from __future__ import annotations

import json
import threading

import torch
import xgrammar as xgr

from dataplane.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A response_format the grammar engine cannot compile (the client's fault: HTTP 400)."""


class GrammarCompiler:
    """Compiles response formats for one tokenizer; thread-safe, results cached by xgrammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.hf, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, kind: str, schema: dict | None = None) -> xgr.CompiledGrammar:
        """``kind`` json_object (any JSON object) or json_schema (``schema``). Compact JSON
        (no free whitespace between tokens), so a model cannot pad its answer with blanks."""
        try:
            if kind == "json_object":
                return self._get().compile_json_schema('{"type": "object"}', any_whitespace=False)
            return self._get().compile_json_schema(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"response_format schema is not supported: {first[:300]}") from e


class GrammarState:
    """One sequence's position in its grammar. Engine thread only."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, max_rollback: int, eos: set[int]):
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback)
        self.vocab_size = vocab_size
        self.eos = sorted(eos)

    def masked(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Mask rows along a draft.

        Args:
            logits: [m, V] target logits of one request; row j scores the token after the
                committed text plus drafts[:j].
            drafts: the m - 1 draft tokens of the request.
        Returns:
            [m, V] float32 copy with disallowed tokens at -inf. Rows after a draft the
            grammar forbids repeat the mask of the row that forbids it (they are never used:
            that draft is rejected there).
        """
        m = logits.shape[0]
        bitmask = xgr.allocate_token_bitmask(m, self.vocab_size)
        accepted = 0
        for j in range(m):
            if j > 0 and accepted == j - 1 and self._accept(drafts[j - 1]):
                accepted += 1
            if accepted == j:
                self._fill(bitmask, j)
            else:
                bitmask[j] = bitmask[accepted]
        if accepted:
            self.matcher.rollback(accepted)
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device))
        return out

    def draft(self, scores: torch.Tensor) -> list[int]:
        """Drafts that follow the grammar.

        Args:
            scores: [n, V] the drafter's log-probabilities in the target vocabulary (plus the
                request's position noise when it is seeded), row j for draft j.
        Returns:
            n tokens, each the best-scoring token the grammar allows after the ones before;
            after the grammar ends (or nothing is allowed) the rest repeat the last one.
        """
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        out: list[int] = []
        accepted = 0
        for j in range(scores.shape[0]):
            if accepted < j:
                out.append(out[-1])
                continue
            self._fill(bitmask, 0)
            row = scores[j : j + 1].float().clone()
            xgr.apply_token_bitmask_inplace(row, bitmask.to(row.device))
            out.append(int(row[0].argmax()))
            accepted += self._accept(out[-1])
        if accepted:
            self.matcher.rollback(accepted)
        return out

    def _accept(self, token: int) -> bool:
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # only the end of the sequence is left
            bitmask[row] = 0
            for t in self.eos:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, tokens: list[int]) -> None:
        """Commit emitted tokens (each one was allowed by the mask it was chosen under)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            self.matcher.accept_token(t)
