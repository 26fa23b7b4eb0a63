"""The demo's traffic: prompts per domain, a client of the node, and what each request saw."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import httpx

DOMAIN = "web-desk"  # the tenants' narrow domain (promptsets/narrow.py): neither offline data nor the benchmark's
TENANTS = {"acme": DOMAIN, "initech": DOMAIN}  # traffic tenant -> its domain (two teams of one agency)
EVAL_TENANT = "demo-eval"  # measurement traffic: feedback opted out
STATE_ORDER = ("registered", "evaluating", "gate_failed", "awaiting_approval", "approved", "canary", "champion",
               "retired", "rejected", "expired", "rolled_back")


def prompts_by_domain(n_eval: int, n_traffic: int) -> tuple[dict[str, list[str]], dict[str, list[str]], str]:
    """(measurement prompts, traffic prompts, source) per domain: the measurement set from the
    domain's held-out split, the tenants' traffic from its stream (training split, never used by
    the offline drafter data)."""
    from promptsets.narrow import NARROW_DOMAINS

    nd = NARROW_DOMAINS[DOMAIN]
    ev = [r["prompt"] for r in nd.heldout(n_eval)]
    tr = [r["prompt"] for r in nd.stream(n_traffic)]
    if not ev or not tr:
        raise ValueError(f"the {DOMAIN} prompt set is empty (held-out {len(ev)}, stream {len(tr)})")
    return {DOMAIN: ev}, {DOMAIN: tr}, f"{DOMAIN}: {nd.description}"


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
