"""Narrow domains: one tenant's traffic, as the adaptation benchmark and the demo stream it.

Each has a stream (training-split prompts that the offline drafter data never uses) and a
held-out set of the same distribution (the held-out split of ``promptsets``, never streamed
nor trained on). Offline data (``learner.data``) takes chat items from the start of the
ShareGPT file: any topic below ``OFFLINE_CHAT_END``, beyond it only those no narrow domain is about
(``offline_chat``). The ShareGPT-based streams start at
``OFFLINE_CHAT_END`` and take only their topic, so the two never share a conversation.

- ``math``, ``support-desk``, ``python-desk``: the adaptation benchmark's domains;
- ``web-desk``: the demo's tenants (front-end JavaScript and TypeScript questions), which
  the benchmark does not use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import promptsets as ds

OFFLINE_CHAT_END = 2000  # ShareGPT file index: offline data of any topic stays below, narrow streams at or above
MAX_PROMPT_CHARS = 600


@dataclass(frozen=True)
class NarrowDomain:
    """A tenant's narrow traffic: where its stream and its held-out prompts come from."""

    name: str
    base: str  # the promptsets domain
    description: str
    stream: Callable[[int], list[dict]]  # n -> training-split prompts never used offline
    heldout: Callable[[int], list[dict]]  # n -> held-out prompts of the same distribution
    split: str = ""  # the datasets.is_heldout rule its ids follow (empty: base)

    @property
    def split_rule(self) -> str:
        return self.split or self.base


def _math_stream(n: int) -> list[dict]:
    # Offline data takes math seeds from 0 upwards (a few thousand at most); the stream
    # starts far beyond, still inside the training split (seeds < 1,000,000).
    return ds.train_prompts("math", n, offset=500_000)


def file_index(row: dict) -> int:
    """A ShareGPT row's index in the file (its id is ``<source>/<index>``)."""
    return int(row["id"].rsplit("/", 1)[-1])


def offline_chat(row: dict) -> bool:
    """Whether offline drafter data may use this training-split ShareGPT row."""
    i = file_index(row)
    if i < OFFLINE_CHAT_END:
        return True
    text = row["prompt"].lower()
    return not any(p.search(text) for p in _TOPICS)


def _topic_chat(words: re.Pattern, heldout: bool, n: int, exclude: re.Pattern | None = None) -> list[dict]:
    """Short ShareGPT prompts about a topic: the held-out split, or the training split from
    ``OFFLINE_CHAT_END`` on."""
    rows = ds.heldout_prompts("chat") if heldout else ds.train_prompts("chat")
    hits = [r for r in rows if len(r["prompt"]) < MAX_PROMPT_CHARS and words.search(r["prompt"].lower())
            and not (exclude and exclude.search(r["prompt"].lower()))
            and (heldout or file_index(r) >= OFFLINE_CHAT_END)]
    return hits[:n]


_PY = re.compile(r"python|pandas|numpy|django|flask")
_WEB = re.compile(r"\b(javascript|typescript|react|next\.js|node\.js|html|css|jquery|vue|angular)\b")
_TOPICS = (_PY, _WEB)  # the ShareGPT-based narrow domains' topics

NARROW_DOMAINS: dict[str, NarrowDomain] = {
    "math": NarrowDomain("math", "math", "grade-school word problems of one tutoring tenant (synthetic "
                         "templates; stream seeds 500,000+, held-out seeds 1,000,000+)",
                         _math_stream, lambda n: ds.heldout_prompts("math", n)),
    "support-desk": NarrowDomain("support-desk", "chat", "one online shop's customer-support messages (synthetic "
                                 "templates: orders, returns, refunds, shipping; stream seeds 0+, held-out "
                                 "seeds 1,000,000+; never used offline)",
                                 lambda n: ds.support_prompts(False, n), lambda n: ds.support_prompts(True, n),
                                 split="support"),
    "python-desk": NarrowDomain("python-desk", "chat", "one support desk's Python questions (ShareGPT "
                                "conversations mentioning Python libraries)",
                                lambda n: _topic_chat(_PY, False, n), lambda n: _topic_chat(_PY, True, n)),
    "web-desk": NarrowDomain("web-desk", "chat", "one agency's front-end questions (ShareGPT conversations about "
                             "JavaScript, TypeScript, React, HTML or CSS, none about Python)",
                             lambda n: _topic_chat(_WEB, False, n, exclude=_PY),
                             lambda n: _topic_chat(_WEB, True, n, exclude=_PY)),
}
