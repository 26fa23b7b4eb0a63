"""One API request in flight: its n engine sequences and what has been sent of each.

Each choice is an engine ``Sequence`` (what decoding needs) added with its
``RequestEnvelope`` (prompt text, domain, trace, token callback); the detokenizer and
what was sent stay here. Tokens come back through the envelope's ``on_update`` (engine
thread) into one asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from dataplane.admission import TenantOverQuota
from dataplane.envelope import RequestEnvelope
from dataplane.node import Node
from dataplane.sampling import CHOICE_STREAM, TokenLogprob, mix_seed
from dataplane.sequence import SamplingParams, Sequence, Status
from dataplane.tokenizer import Detokenizer
from dataplane.tracing import attach

DISCONNECT_POLL_S = 1.0
STALE_S = 600.0  # an in-flight entry whose choices all finished this long ago is dropped


@dataclass
class Choice:
    index: int
    seq: Sequence
    envelope: RequestEnvelope
    detok: Detokenizer
    sent_logprobs: int = 0  # logprob entries already handed out
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Delta:
    """What one choice adds since the last delta."""

    choice: Choice
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ids_before: list[int] = field(default_factory=list)  # output tokens preceding ``logprobs``
    finish_reason: str | None = None


class Generation:
    def __init__(self, node: Node, prompt_ids: list[int], prompt_text: str, tenant: str, params: SamplingParams,
                 n: int, domain: str | None, chat: bool):
        self.node = node
        self.prompt_ids = prompt_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        loop = asyncio.get_running_loop()
        for i in range(n):
            seed = params.seed
            if seed is not None and i > 0:  # choice 0 is what n=1 gives; the others their own streams
                seed = mix_seed(seed, CHOICE_STREAM + i)
            p = SamplingParams(**{**params.__dict__, "stop": list(params.stop or []), "seed": seed})
            seq = Sequence(request_id=self.id if n == 1 else f"{self.id}-{i}", prompt_ids=list(prompt_ids),
                           params=p, tenant_id=tenant)
            env = RequestEnvelope(prompt_text=prompt_text, domain=domain, on_update=self._callback(loop, i))
            self.choices.append(Choice(i, seq, env, node.new_detokenizer(p.stop)))

    def _callback(self, loop: asyncio.AbstractEventLoop, index: int):
        def on_update(_s: Sequence, _new: list[int], finished: bool) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, (index, finished))

        return on_update

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.choices]

    def start(self) -> None:
        """Queue every choice; if the tenant is over its quota part-way, withdraw those queued."""
        added = []
        try:
            for c in self.choices:
                attach(c.seq, c.envelope)
                self.node.engine.add(c.seq, c.envelope)
                added.append(c.seq)
        except TenantOverQuota:
            for seq in added:
                self.node.engine.cancel(seq.request_id)
            raise

    def cancel(self) -> None:
        for c in self.choices:
            if c.seq.finished_at is None:
                self.node.engine.cancel(c.seq.request_id)

    def _delta(self, c: Choice, finished: bool) -> Delta:
        seq = c.seq
        text = c.detok.update(list(seq.output_ids), final=finished)
        if c.detok.stopped and not finished:
            seq.finish_reason = "stop"
            self.node.engine.cancel(seq.request_id)
        n = len(seq.logprobs)
        d = Delta(c, text, seq.logprobs[c.sent_logprobs : n], seq.output_ids[: c.sent_logprobs])
        c.sent_logprobs = n
        if finished or c.detok.stopped:
            c.finish_reason = "stop" if c.detok.stopped else seq.finish_reason
            d.finish_reason = c.finish_reason
        return d

    async def deltas(self, request: Request | None = None) -> AsyncIterator[Delta]:
        """Deltas of all choices in arrival order until every choice is done; a client that
        went away (checked every second while idle) cancels the rest."""
        while not all(c.done for c in self.choices):
            try:
                index, finished = await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.cancel()
                    return
                for c in self.choices:  # level-triggered too: a choice the engine finished is delivered
                    if not c.done and c.seq.status is Status.FINISHED and c.seq.finish_reason is not None:
                        yield self._delta(c, True)
                continue
            c = self.choices[index]
            if c.done:
                continue
            yield self._delta(c, finished)

    @property
    def error(self) -> str | None:
        return next((c.seq.error or "engine error" for c in self.choices if c.finish_reason == "error"), None)


@dataclass
class _Open:
    path: str
    tenant: str
    started: float
    stage: str = "validating"
    gen: Generation | None = None
    changed: float = 0.0


class InflightRequests:
    """Completion requests in the HTTP layer, from validation to their last byte, with the
    stage each has reached and where the engine holds its choices (``GET /admin/requests``):
    what an operator looks at when a client says its request hangs."""

    def __init__(self):
        self._open: dict[int, _Open] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def open(self, path: str, tenant: str) -> int:
        key, now = next(self._keys), time.monotonic()
        with self._lock:
            # a stream whose body was never iterated (client gone first) never closes its entry
            for k in [k for k, o in self._open.items() if o.gen is not None and now - o.changed > STALE_S
                      and all(c.seq.status is Status.FINISHED for c in o.gen.choices)]:
                del self._open[k]
            self._open[key] = _Open(path, tenant, now, changed=now)
        return key

    def stage(self, key: int, stage: str, gen: Generation | None = None) -> None:
        with self._lock:
            o = self._open.get(key)
            if o is not None:
                o.stage, o.changed = stage, time.monotonic()
                o.gen = gen or o.gen

    def close(self, key: int) -> None:
        with self._lock:
            self._open.pop(key, None)

    def __len__(self) -> int:
        return len(self._open)

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        with self._lock:
            items = list(self._open.values())
        out = []
        for o in sorted(items, key=lambda o: o.started):
            row = {"path": o.path, "tenant": o.tenant, "stage": o.stage, "age_s": round(now - o.started, 3),
                   "stage_age_s": round(now - o.changed, 3), "id": None, "choices": []}
            if o.gen is not None:
                row["id"] = o.gen.id
                row["choices"] = [{"index": c.index, "engine_status": c.seq.status.value,
                                   "finished_in_engine": c.seq.status is Status.FINISHED,
                                   "engine_finish_reason": c.seq.finish_reason, "delivered": c.done,
                                   "output_tokens": len(c.seq.output_ids), "pending_updates": o.gen.queue.qsize()}
                                  for c in o.gen.choices]
            out.append(row)
        return out
