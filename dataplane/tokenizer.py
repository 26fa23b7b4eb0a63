"""Tokenizer and chat template of the target, plus incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, directory: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        # Templated text already starts with the special tokens it needs (DATA.md).
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat(self, messages: list[dict]) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text that could still become a stop string, or ends in an incomplete UTF-8 sequence,
    is held back until it is decided.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.emitted = 0  # characters of the decoded text already sent
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        """Decode ``ids`` (all output so far); return the new text that is safe to send."""
        text = self.tok.decode(ids)
        cut = None
        for s in self.stop:
            i = text.find(s)
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:n]):
                        safe -= n
                        break
        safe = max(safe, self.emitted)
        delta = text[self.emitted:safe]
        self.emitted = safe
        return delta


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTES = _byte_decoder()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes one token stands for (a token may hold part of a character)."""
    piece = tokenizer.hf.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    return piece.encode("utf-8")
