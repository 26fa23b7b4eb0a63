"""The demo's traffic: prompts per domain, a client of the node, and what each request saw."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import httpx

TENANTS = {"acme": "code", "globex": "math", "initech": "chat"}  # traffic tenant -> its domain
EVAL_TENANT = "demo-eval"  # measurement traffic: feedback opted out
FALLBACK_PROMPTS = {
    "chat": ["Give three tips for a good night's sleep.", "What is the difference between weather and climate?",
             "Write a short thank-you note to a colleague.", "Explain what a mortgage is in two sentences.",
             "Suggest a name for a bakery and say why.", "How do I politely decline a meeting?"],
    "code": ["def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
             "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "def count_vowels(s: str) -> int:\n    \"\"\"Count the vowels in s.\"\"\"\n",
             "def flatten(xs: list) -> list:\n    \"\"\"Flatten a nested list.\"\"\"\n"],
    "math": ["Tom has 12 apples and gives 5 to Ann. How many apples does Tom have left?",
             "A train travels 60 km per hour for 3 hours. How far does it go?",
             "Sara buys 4 pens at 3 dollars each. How much does she pay?",
             "There are 30 students and 6 groups. How many students are in each group?"],
}
STATE_ORDER = ("registered", "evaluating", "gate_failed", "awaiting_approval", "approved", "canary", "champion",
               "retired", "rejected", "expired", "rolled_back")


def prompts_by_domain(n_eval: int, n_traffic: int) -> tuple[dict[str, list[str]], dict[str, list[str]], str]:
    """(measurement prompts, traffic prompts, source) per domain, disjoint."""
    try:
        from promptsets import DOMAINS, heldout_prompts

        ev, tr = {}, {}
        for d in DOMAINS:
            rows = [r["prompt"] for r in heldout_prompts(d, n_eval + n_traffic)]
            if len(rows) < n_eval + 1:
                raise ValueError(f"too few held-out prompts for {d}")
            ev[d], tr[d] = rows[:n_eval], rows[n_eval:]
        return ev, tr, "held-out split of promptsets"
    except Exception as e:  # noqa: BLE001 - datasets not installed: the built-in list
        ev = {d: p[: max(1, len(p) // 2)] for d, p in FALLBACK_PROMPTS.items()}
        tr = {d: p[max(1, len(p) // 2):] for d, p in FALLBACK_PROMPTS.items()}
        return ev, tr, f"built-in prompts ({type(e).__name__})"


@dataclass
class Result:
    domain: str
    tenant: str
    ok: bool
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    seconds: float = 0.0
    version: str | None = None
    error: str = ""
    at: float = field(default_factory=time.time)


def tau_of(results: list[Result]) -> float:
    rounds = sum(r.rounds for r in results)
    return (sum(r.accepted for r in results) + rounds) / rounds if rounds else 0.0


def tps_of(results: list[Result]) -> float:
    """Mean tokens/s a client saw per request."""
    rs = [r.tokens / r.seconds for r in results if r.ok and r.seconds > 0]
    return sum(rs) / len(rs) if rs else 0.0


class Client:
    def __init__(self, node_url: str, max_tokens: int):
        self.node_url = node_url
        self.max_tokens = max_tokens
        self.http = httpx.Client(timeout=600)

    def complete(self, prompt: str, domain: str, tenant: str) -> Result:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": self.max_tokens,
                "temperature": 0.0, "domain": domain}
        t0 = time.monotonic()
        try:
            r = self.http.post(f"{self.node_url}/v1/chat/completions", json=body, headers={"X-Tenant-ID": tenant})
        except httpx.HTTPError as e:
            return Result(domain, tenant, False, error=type(e).__name__)
        dt = time.monotonic() - t0
        if r.status_code != 200:
            return Result(domain, tenant, False, seconds=dt, error=f"HTTP {r.status_code}")
        u = r.json()["usage"]
        spec = u.get("speculative") or {}
        return Result(domain, tenant, True, tokens=u["completion_tokens"], rounds=spec.get("rounds", 0),
                      accepted=spec.get("accepted_tokens", 0), seconds=dt, version=spec.get("drafter_version"))


def run_batch(client: Client, jobs: list[tuple[str, str, str]], concurrency: int,
              sink: list[Result], stop: threading.Event | None = None) -> list[Result]:
    """Serve (prompt, domain, tenant) jobs with ``concurrency`` threads; results also go to ``sink``."""
    q: queue.Queue = queue.Queue()
    for j in jobs:
        q.put(j)
    out: list[Result] = []
    lock = threading.Lock()

    def worker():
        while not (stop and stop.is_set()):
            try:
                prompt, domain, tenant = q.get_nowait()
            except queue.Empty:
                return
            res = client.complete(prompt, domain, tenant)
            with lock:
                out.append(res)
                sink.append(res)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
