"""What travels with a request around the engine but is none of its decoding state.

The engine's ``Sequence`` holds what decoding needs (tokens, sampling, KV, rounds, and the
tenant as its admission key). The envelope holds the rest: the prompt text and domain the
feedback record ships, the request's trace, and where its tokens go. The engine keeps it
beside the sequence (``Engine.add(seq, envelope)``), calls ``on_update`` with committed
tokens and hands it back with the finished sequence (``Engine.on_finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dataplane.sequence import Sequence

# Called on the engine thread with (sequence, new token ids, finished); it must not block.
OnUpdate = Callable[["Sequence", list[int], bool], None]


@dataclass
class RequestEnvelope:
    prompt_text: str = ""  # the prompt as sent (chat prompts templated); the feedback record's text
    domain: str | None = None  # optional tag the client sent
    traceparent: str | None = None  # W3C traceparent of the request span (dataplane.tracing)
    on_update: OnUpdate | None = None
