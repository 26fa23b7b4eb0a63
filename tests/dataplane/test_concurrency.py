"""200 concurrent clients, malformed requests and disconnects among them: nobody else suffers."""

from __future__ import annotations

import asyncio
import re

import httpx


def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created") and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _valid(client, i):
    r = await client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True}, headers={"X-Tenant-ID": f"t{i % 3}"})
    return "valid", r.status_code, r.json()


async def _malformed(client, i):
    body = [b"{oops", b"", b'{"prompt": ""}', b'{"prompt": "x", "temperature": -1}'][i % 4]
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    return "malformed", r.status_code, r.json()


async def _disconnect(client, i):
    try:
        async with client.stream("POST", "/v1/completions", json={"prompt": f"leave {i}", "max_tokens": 60,
                                                                   "stream": True, "ignore_eos": True}) as r:
            async for _ in r.aiter_lines():
                break  # read one event, then hang up
    except httpx.HTTPError:
        pass
    return "disconnect", None, None


def test_200_concurrent_requests(server):
    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            jobs = []
            for i in range(200):
                kind = i % 10
                jobs.append(_malformed(client, i) if kind == 3 else _disconnect(client, i) if kind == 7
                            else _valid(client, i))
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    valid = [r for r in results if r[0] == "valid"]
    bad = [r for r in results if r[0] == "malformed"]
    assert len(valid) == 160 and all(code == 200 for _, code, _ in valid)
    assert all(body["usage"]["completion_tokens"] == 6 for _, _, body in valid)
    assert all(code == 400 and "error" in body for _, code, body in bad)
    metrics = httpx.get(f"{server.url}/metrics").text
    # Every valid request finished with "length"; disconnected ones were cancelled or ran out.
    finished_length = sum(float(m) for m in re.findall(r'adaflash_requests_total\{finish_reason="length",'
                                                        r'tenant="t\d"\} ([0-9.e+]+)', metrics))
    assert finished_length >= 160
    assert _counter(metrics, "adaflash_requests_rejected_total") >= 20
    assert _counter(metrics, "adaflash_queue_depth") == 0
    assert httpx.get(f"{server.url}/healthz").status_code == 200
