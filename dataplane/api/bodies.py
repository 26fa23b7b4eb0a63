"""OpenAI response bodies: choices, logprobs (chat and legacy shapes), usage, chunks."""

from __future__ import annotations

from adaflash.contracts.serving import SpeculativeUsage, Usage
from dataplane.sampling import TokenLogprob
from dataplane.sequence import Round, Sequence
from dataplane.tokenizer import Tokenizer, token_bytes


def _piece(tok: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = token_bytes(tok, token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a chat completion: {"content": [...], "refusal": None}."""
    content = []
    for e in entries:
        text, raw = _piece(tok, e.token)
        top = []
        for tid, lp in e.top:
            t_text, t_raw = _piece(tok, tid)
            top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Tokenizer, entries: list[TokenLogprob], ids_before: list[int], offset0: int) -> dict:
    """Legacy ``choices[].logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    ids_before: the output tokens that precede ``entries``; offset0: the length of their
    text, so offsets count characters of the whole completion text.
    """
    tokens, values, tops, offsets = [], [], [], []
    ids = list(ids_before)
    offset = offset0
    for e in entries:
        offsets.append(offset)
        tokens.append(_piece(tok, e.token)[0])
        values.append(e.logprob)
        tops.append({_piece(tok, tid)[0]: lp for tid, lp in e.top})
        ids.append(e.token)
        offset = len(tok.decode(ids))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, seqs: list[Sequence]) -> dict:
    """Usage of a request's choices; ``speculative`` sums their rounds."""
    rounds: list[Round] = [r for s in seqs for r in s.rounds]
    acc = sum(r.accepted for r in rounds)
    ver = sum(r.k_hat for r in rounds)
    spec = SpeculativeUsage(
        rounds=len(rounds), draft_tokens=sum(r.k_hat - 1 for r in rounds), verified_tokens=ver,
        accepted_tokens=acc, mean_accept_len=(acc + len(rounds)) / len(rounds) if rounds else 0.0,
        mean_verify_len=ver / len(rounds) if rounds else 0.0,
        drafter_version=next((s.drafter_version for s in seqs if s.drafter_version), None))
    completion = sum(len(s.output_ids) for s in seqs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 speculative=spec).model_dump()
