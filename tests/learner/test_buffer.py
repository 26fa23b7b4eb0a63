"""Replay buffer policy: per-tenant share cap, TTL, opt-out, in-buffer duplicates."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from adaflash.contracts.tenancy import TenantPolicy
from learner.buffer import Item, ReplayBuffer, StaticPolicies
from learner.supervision import Tokenized
from tests.learner.tiny import make_record

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def _item(tenant, offset, age_days=0.0, partition=0):
    rec = make_record(tenant=tenant, created_at=NOW - timedelta(days=age_days))
    return Item(Tokenized(rec, [1, 2, 3], 1), partition, offset, arrived=0.0)


def _buffer(policies, capacity=8, **kw):
    clock = {"now": NOW, "mono": 0.0}
    buf = ReplayBuffer(capacity, policies, clock=lambda: clock["now"], monotonic=lambda: clock["mono"], **kw)
    return buf, clock


def test_no_tenant_above_its_share_cap_and_overflow_is_deferred_not_lost():
    buf, _ = _buffer(StaticPolicies(share_cap=0.5), capacity=8)
    outcomes = [buf.offer(_item("big", i)) for i in range(10)] + [buf.offer(_item("small", 10 + i)) for i in range(3)]
    assert outcomes.count("buffered") == 4 + 3 and outcomes.count("deferred") == 6
    train, gone = buf.take()
    assert [i.record.tenant_id for i in train].count("big") == 4 and not gone
    train2, _ = buf.take()  # the deferred records form the next buffers, still capped
    assert [i.offset for i in train2] == [4, 5, 6, 7]
    train3, _ = buf.take()
    assert [i.offset for i in train3] == [8, 9] and not buf.held()


def test_single_tenant_trains_partial_buffers_after_max_wait():
    buf, clock = _buffer(StaticPolicies(share_cap=0.5), capacity=8, max_wait_s=5)
    for i in range(8):
        buf.offer(_item("only", i))
    assert not buf.ready()
    clock["mono"] = 6.0
    assert buf.ready()
    train, _ = buf.take()
    assert len(train) == 4


def test_per_tenant_cap_and_ttl_come_from_the_policy_source():
    policies = StaticPolicies({"strict": TenantPolicy(tenant_id="strict", share_cap=0.25, ttl_days=1),
                               "gone": TenantPolicy(tenant_id="gone", opt_out=True)})
    buf, clock = _buffer(policies, capacity=8)
    assert [buf.offer(_item("strict", i)) for i in range(3)] == ["buffered", "buffered", "deferred"]
    assert buf.offer(_item("strict", 9, age_days=2)) == "expired"
    assert buf.offer(_item("gone", 10)) == "opt_out"
    # A record that was fresh when buffered but outlives its TTL while waiting is dropped at take().
    clock["now"] = NOW + timedelta(days=1, hours=1)
    train, gone = buf.take()
    assert not train and len(gone) == 3 and buf.dropped["expired"] == 4


def test_same_record_id_is_held_once():
    buf, _ = _buffer(StaticPolicies(), capacity=8)
    it = _item("a", 0)
    assert buf.offer(it) == "buffered"
    assert buf.offer(Item(it.tok, 0, 1)) == "duplicate"


def test_evaluation_records_are_never_buffered():
    from adaflash.contracts.feedback import is_evaluation_record

    rid = next(f"r{i}" for i in range(1000) if is_evaluation_record(f"r{i}"))
    buf, _ = _buffer(StaticPolicies())
    rec = make_record(record_id=rid, created_at=NOW)
    assert buf.offer(Item(Tokenized(rec, [1, 2, 3], 1), 0, 0, arrived=0.0)) == "held_out"
    assert buf.dropped["held_out"] == 1


def test_records_that_wait_past_max_age_are_shed_as_stale_and_fresh_ones_kept():
    buf, clock = _buffer(StaticPolicies(share_cap=1.0), capacity=2, max_age_s=60.0)
    old = Item(Tokenized(make_record(created_at=NOW - timedelta(seconds=61)), [1, 2, 3], 1), 0, 0, arrived=0.0)
    assert buf.offer(old) == "stale"  # already too old when read
    held = [_item("t", i) for i in range(5)]
    assert [buf.offer(i) for i in held] == ["buffered"] * 2 + ["deferred"] * 3
    assert buf.shed_stale() == []
    clock["now"] = NOW + timedelta(seconds=30)
    late = _item("t", 9)
    late.tok = Tokenized(make_record(created_at=clock["now"]), [1, 2, 3], 1)
    assert buf.offer(late) == "deferred"
    clock["now"] = NOW + timedelta(seconds=61)  # the first five waited too long, the late one did not
    shed = buf.shed_stale()
    assert shed == held and buf.held() == [late] and buf.dropped["stale"] == 1 + 5
    train, gone = buf.take()
    assert train == [] and gone == []
    assert buf.items == [late]


def test_without_max_age_nothing_is_ever_stale():
    buf, clock = _buffer(StaticPolicies(share_cap=1.0), capacity=2)
    it = _item("t", 0)
    assert buf.offer(it) == "buffered"
    clock["now"] = NOW + timedelta(days=1)
    assert buf.shed_stale() == [] and buf.held() == [it]
