"""Mixed client traffic of the soak bench: every request a record of what happened.

Kinds: chat, code (completions), stream (chat, SSE), sampled (temperature 0.8), malformed
(bad JSON or a bad field: must get a 4xx JSON error), disconnect (a stream the client
drops after the first chunk). Tenants t0..tN-1 share the load; one more tenant, ``flood``,
sends as fast as its own threads can, to node 1 only. A request whose node is down
(connection refused or reset) is retried once on the next node.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import asdict, dataclass

import httpx

KINDS = ("chat", "code", "stream", "sampled", "malformed", "disconnect")
FLOOD_TENANT = "flood"
FALLBACK_PROMPTS = {"chat": ["Explain what a hash map is in two sentences.", "Give me three tips for sleeping better."],
                    "code": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]}


@dataclass
class Event:
    t: float  # seconds since the soak began
    kind: str
    tenant: str
    node: int
    status: int  # HTTP status; 0: no answer (connection failed)
    ttft_s: float | None
    latency_s: float
    retried: bool = False
    error: str | None = None


def load_prompts(n: int = 16) -> dict[str, list[str]]:
    """Held-out prompts (never trained on) of the chat and code domains; built-in ones if absent."""
    out = {}
    for domain in ("chat", "code"):
        try:
            from promptsets import heldout_prompts

            out[domain] = [r["prompt"][:600] for r in heldout_prompts(domain, n)] or FALLBACK_PROMPTS[domain]
        except Exception:  # noqa: BLE001 - the dataset package is optional for a soak
            out[domain] = FALLBACK_PROMPTS[domain]
    return out


class Traffic:
    def __init__(self, urls: list[str], tenants: int, concurrency: int, prompts: dict[str, list[str]],
                 max_tokens: int = 16, flood_threads: int = 4, seed: int = 0, node_admin_token: str | None = None,
                 stuck_after_s: float = 45.0):
        self.urls, self.tenants, self.concurrency = urls, [f"t{i}" for i in range(tenants)], concurrency
        self.prompts, self.max_tokens, self.flood_threads = prompts, max_tokens, flood_threads
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._rng = random.Random(seed)
        self._kinds = itertools.cycle(KINDS)
        self._threads: list[threading.Thread] = []
        self._open: dict[int, tuple[float, str, str, int]] = {}  # request id -> (start, kind, tenant, node)
        self._ids = itertools.count()
        self.node_admin_token, self.stuck_after_s = node_admin_token, stuck_after_s
        self.stuck: list[dict] = []  # what a node said of its requests in flight when one of ours hung

    def start(self) -> None:
        self._t0 = time.monotonic()
        for i in range(self.concurrency):
            self._threads.append(threading.Thread(target=self._client, args=(i,), daemon=True))
        for _ in range(self.flood_threads):
            self._threads.append(threading.Thread(target=self._flood, daemon=True))
        if self.node_admin_token:
            self._threads.append(threading.Thread(target=self._watch, daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _record(self, e: Event) -> None:
        with self._lock:
            self.events.append(e)

    # --- clients -------------------------------------------------------------------------------------
    def _client(self, i: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                with self._lock:
                    kind = next(self._kinds)
                tenant = self.tenants[(i + n) % len(self.tenants)]
                self._one(client, kind, tenant, (i + n) % len(self.urls))

    def _watch(self) -> None:
        """A request open past ``stuck_after_s``: ask its node what it holds (GET /admin/requests)."""
        seen: set[int] = set()
        with httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {self.node_admin_token}"}) as client:
            while not self._stop.wait(5.0):
                with self._lock:
                    late = [(rid, v) for rid, v in self._open.items()
                            if rid not in seen and self.now() - v[0] > self.stuck_after_s]
                for rid, (t0, kind, tenant, node) in late:
                    seen.add(rid)
                    try:
                        state = client.get(f"{self.urls[node]}/admin/requests").json()
                    except (httpx.HTTPError, ValueError) as e:
                        state = {"error": f"{type(e).__name__}: {e}"}
                    self.stuck.append({"t": t0, "kind": kind, "tenant": tenant, "node": node,
                                       "asked_at": self.now(), "node_state": state})

    def _flood(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            while not self._stop.is_set():
                t0 = self.now()
                try:
                    r = client.post(f"{self.urls[0]}/v1/completions", headers={"X-Tenant-ID": FLOOD_TENANT},
                                    json={"prompt": "Write a long story about the sea.", "max_tokens": 32})
                    status = r.status_code
                except httpx.HTTPError as e:
                    status, _ = 0, e
                self._record(Event(t0, "flood", FLOOD_TENANT, 0, status, None, self.now() - t0))
                if status in (0, 429):
                    time.sleep(0.2)

    def _body(self, kind: str) -> tuple[str, dict | bytes]:
        if kind == "code":
            return "/v1/completions", {"prompt": self._rng.choice(self.prompts["code"]), "max_tokens": self.max_tokens}
        if kind == "malformed":
            return "/v1/chat/completions", self._rng.choice(
                [b"{not json", {"messages": "hello"}, {"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": -3}, {"prompt": 12}])
        msg = [{"role": "user", "content": self._rng.choice(self.prompts["chat"])}]
        body = {"messages": msg, "max_tokens": self.max_tokens}
        if kind == "sampled":
            body.update(temperature=0.8, top_p=0.95, seed=self._rng.randrange(1 << 30))
        if kind in ("stream", "disconnect"):
            body["stream"] = True
        return "/v1/chat/completions", body

    def _one(self, client: httpx.Client, kind: str, tenant: str, node: int) -> None:
        path, body = self._body(kind)
        t0 = self.now()
        rid = next(self._ids)
        with self._lock:
            self._open[rid] = (t0, kind, tenant, node)
        try:
            self._attempts(client, kind, tenant, node, path, body, t0)
        finally:
            with self._lock:
                self._open.pop(rid, None)

    def _attempts(self, client, kind, tenant, node, path, body, t0) -> None:
        for attempt in range(2):
            url = self.urls[(node + attempt) % len(self.urls)] + path
            try:
                status, ttft, err = self._send(client, url, kind, tenant, body)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                status, ttft, err = 0, None, f"{type(e).__name__}"
                if attempt == 0:
                    continue  # node down: the next one (a malformed request too: it is owed a 4xx)
            except httpx.TimeoutException as e:  # a hung answer: recorded, never retried
                status, ttft, err = 0, None, f"{type(e).__name__}"
            self._record(Event(t0, kind, tenant, (node + attempt) % len(self.urls), status,
                               None if ttft is None else ttft - t0, self.now() - t0, attempt > 0, err))
            return

    def _send(self, client, url, kind, tenant, body) -> tuple[int, float | None, str | None]:
        headers = {"X-Tenant-ID": tenant}
        if isinstance(body, bytes):
            r = client.post(url, content=body, headers={**headers, "content-type": "application/json"})
            return r.status_code, None, _error_of(r)
        if not body.get("stream"):
            r = client.post(url, json=body, headers=headers)
            return r.status_code, self.now() if r.status_code == 200 else None, _error_of(r)
        with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, None, _error_of(r)
            ttft = None
            for line in r.iter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = self.now()
                    if kind == "disconnect":
                        return 200, ttft, None  # the client goes away mid-stream
                if line == "data: [DONE]":
                    break
            return 200, ttft, None

    def still_open(self) -> list[dict]:
        """Requests that had not ended when asked (after ``stop``: hung past its join timeout)."""
        with self._lock:
            return [{"t": t, "kind": k, "tenant": tn, "node": n, "open_s": self.now() - t}
                    for t, k, tn, n in self._open.values()]

    def summary(self) -> list[dict]:
        with self._lock:
            return [asdict(e) for e in self.events]


def _error_of(r: httpx.Response) -> str | None:
    if r.status_code < 400:
        return None
    try:
        err = r.json()["error"]
        return f"{err.get('code') or err.get('type')}: {str(err.get('message'))[:120]}"
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI-shaped error: {r.text[:120]!r}"


def is_json_error(e: dict) -> bool:
    return e["error"] is not None and not e["error"].startswith("not an OpenAI-shaped")
