"""Tenant-fair admission: a flooding tenant neither delays another beyond its fair share nor
queues past its limit (counted in engine steps and queue positions, never in wall time)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from adaflash.contracts.tenancy import TenantPolicy
from dataplane.admission import FairQueue, TenantLimits
from dataplane.sequence import SamplingParams, Sequence
from governance.policy import StaticPolicySource
from tests.dataplane.engine_util import make_engine


def _seq(rid: str, tenant: str, max_tokens: int = 8, prompt_len: int = 4) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(3, 3 + prompt_len)), tenant_id=tenant,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_newcomer_goes_next_after_a_flood():
    q = FairQueue()
    for i in range(50):
        q.append(_seq(f"a{i}", "A"))
    q.popleft()
    q.append(_seq("b0", "B"))
    order = [q.popleft().request_id for _ in range(3)]
    assert "b0" in order[:2], order  # first come, first served would pop it 50th


def test_weights_share_a_backlog():
    q = FairQueue(weight_of=lambda t: 3.0 if t == "gold" else 1.0)
    for i in range(40):
        q.append(_seq(f"g{i}", "gold"))
        q.append(_seq(f"s{i}", "silver"))
    first = [q.popleft().tenant_id for _ in range(40)]
    assert first.count("gold") == 30 and first.count("silver") == 10


def test_flood_does_not_delay_other_tenant_beyond_its_fair_share(tiny_target):
    """Two running slots; tenant A queues 30 requests, then B sends one. B waits for one slot
    to free (one request's length in steps), not for A's backlog (15 times that)."""
    max_tokens = 8
    engine = make_engine(tiny_target, mode="ar", max_running=2)
    flood = [_seq(f"a{i}", "A", max_tokens) for i in range(30)]
    for s in flood:
        engine.add(s)
    for _ in range(3):
        engine.step()
    b = _seq("b", "B", max_tokens)
    engine.add(b)
    steps = 0
    while b.prefill_at is None:
        engine.step()
        steps += 1
    assert steps <= max_tokens + 1
    admitted_later = [s for s in flood if s.prefill_at is None]
    assert len(admitted_later) >= 25  # A's earlier requests still wait behind B
    engine.run_until_idle()
    assert b.finish_reason == "length" and all(s.finish_reason == "length" for s in flood)
    assert engine.admission.snapshot() == {}  # every queued request and token was released


def test_limits_come_from_policy_else_config(tiny_target):
    engine = make_engine(tiny_target, mode="ar", tenant_max_queued=7)
    adm = engine.admission
    adm.policy = StaticPolicySource({"gold": TenantPolicy(tenant_id="gold", weight=4.0, max_tokens=100)})
    assert adm.limits("gold") == TenantLimits(1.0, 7, 0)  # defaults until the policy has been read
    for _ in range(200):
        if adm.limits("gold").weight == 4.0:
            break
        time.sleep(0.01)
    assert adm.limits("gold") == TenantLimits(4.0, 7, 100)
    adm.close()


def test_token_budget_refuses_what_does_not_fit(tiny_target):
    from dataplane.admission import TenantOverQuota

    engine = make_engine(tiny_target, mode="ar")
    engine.admission.set_limits("A", TenantLimits(1.0, 0, 30))
    engine.add(_seq("a0", "A", max_tokens=20, prompt_len=4))  # 24 tokens in flight
    with pytest.raises(TenantOverQuota) as e:
        engine.add(_seq("a1", "A", max_tokens=20, prompt_len=4))
    assert e.value.reason == "tenant_token_budget" and e.value.retry_after_s >= 1
    engine.add(_seq("b0", "B", max_tokens=20, prompt_len=4))  # another tenant is not affected
    engine.run_until_idle()
    engine.add(_seq("a2", "A", max_tokens=20, prompt_len=4))  # the budget came back


def test_http_429_with_retry_after_when_queue_limit_is_hit(tiny_node, server):
    engine = tiny_node.engine
    engine.admission.set_limits("flood", TenantLimits(1.0, 2, 0))
    engine.stop()  # nothing is admitted while the engine is stopped: the queue fills
    body = {"prompt": "hello there", "max_tokens": 4}
    results: list[int] = []

    def send():
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Tenant-ID": "flood"}, timeout=60)
        results.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for _ in range(500):
            if engine.admission.snapshot().get("flood", {}).get("queued") == 2:
                break
            time.sleep(0.01)
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Tenant-ID": "flood"}, timeout=10)
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "tenant_queue_full" and err["type"] == "rate_limit_error" and "flood" in err["message"]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'adaflash_tenant_rejected_total{reason="tenant_queue_full",tenant="flood"} 1.0' in metrics
        assert 'adaflash_tenant_queue_depth{tenant="flood"} 2.0' in metrics
    finally:
        engine.start()
        for t in threads:
            t.join(timeout=60)
    assert results == [200, 200]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'adaflash_tenant_admitted_total{tenant="flood"} 2.0' in metrics
    assert 'adaflash_tenant_queue_depth{tenant="flood"} 0.0' in metrics
    ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Tenant-ID": "other"}, timeout=60)
    assert ok.status_code == 200


def test_a_failed_prefill_finishes_its_requests_and_frees_the_quota(tiny_target):
    engine = make_engine(tiny_target, mode="ar")
    seqs = [_seq(f"a{i}", "A") for i in range(3)]
    for s in seqs:
        engine.add(s)

    def broken(_batch):
        raise RuntimeError("prefill broke")

    engine._prefill = broken
    engine.step()
    assert all(s.finish_reason == "error" for s in seqs)
    assert engine.admission.snapshot() == {}
