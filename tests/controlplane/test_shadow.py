"""Shadow evaluation: the replay reproduces the engine's own rounds; windows, reports, plots."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from adaflash.contracts.evaluation import EvaluationReport
from adaflash.contracts.feedback import is_evaluation_record
from controlplane.shadow import (
    RecordsWindow,
    evaluate_drafters,
    replay_drafter,
    select_window,
    target_pass,
    write_plots,
)
from dataplane.drafter import new_drafter
from dataplane.spec_policy import PolicyConfig
from tests.controlplane.shadow_util import evaluation_ids, record, train_drafter
from tests.dataplane.engine_util import make_engine, prompts, run

PAPER_RULE = PolicyConfig(mode="adaptive", block_size=8, breakeven=False)  # the engines below run it


class IdsTokenizer:
    """Text is space-separated token ids (the tiny target has no tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def corpus(tiny_target):
    seqs = run(make_engine(tiny_target, "ar"), prompts(8, 97, seed=3, lo=4, hi=12), max_tokens=20)
    return [(s.prompt_ids, s.output_ids) for s in seqs]


@pytest.fixture(scope="module")
def trained(tiny_target, corpus):
    d = new_drafter(tiny_target, seed=1, num_layers=1, n_target_layers=2, block_size=8)
    return train_drafter(d, tiny_target, [p + r for p, r in corpus], steps=160, lr=4e-3)


@pytest.fixture(scope="module")
def untrained(tiny_target):
    return new_drafter(tiny_target, seed=2, num_layers=1, n_target_layers=2, block_size=8).eval()


def test_held_out_rule_is_stable_and_about_a_tenth():
    ids = [f"r{i}" for i in range(5000)]
    share = sum(map(is_evaluation_record, ids)) / len(ids)
    assert 0.08 < share < 0.12
    assert [is_evaluation_record(i) for i in ids[:50]] == [is_evaluation_record(i) for i in ids[:50]]
    assert all(is_evaluation_record(i) for i in evaluation_ids(5))
    assert not any(is_evaluation_record(i) for i in evaluation_ids(5, held_out=False))


def test_replay_reproduces_the_engines_rounds(tiny_target, corpus, trained):
    """The simulated walk equals what the engine did with the same drafter (greedy, adaptive)."""
    ps = [p for p, _ in corpus[:6]]
    seqs = run(make_engine(tiny_target, "adaptive", trained, breakeven=False), ps, max_tokens=20)
    layers = list(trained.config.target_layers)
    accepted_total = 0
    for s in seqs:
        ids = s.prompt_ids + s.output_ids
        hidden, _ = target_pass(tiny_target, ids, layers, None)
        rep = replay_drafter(trained, hidden, ids, len(s.prompt_ids), policy=PAPER_RULE)
        assert rep.rounds == len(s.rounds)
        assert rep.verified == sum(r.k_hat for r in s.rounds)
        assert rep.committed == sum(r.accepted + 1 for r in s.rounds) == len(s.output_ids) - 1
        accepted_total += sum(r.accepted for r in s.rounds)
    assert accepted_total > 0  # the trained drafter really speculates


def test_near_greedy_sampling_agrees_with_exact_acceptance(tiny_target, corpus, trained):
    p, r = corpus[0]
    ids = p + r
    hidden, logits = target_pass(tiny_target, ids, list(trained.config.target_layers), len(p))
    exact = replay_drafter(trained, hidden, ids, len(p), policy=PAPER_RULE)
    sampled = replay_drafter(trained, hidden, ids, len(p), policy=PAPER_RULE, temperature=1e-4, target_logits=logits)
    for i in range(3):
        assert sampled.accept_num[i] == pytest.approx(exact.accept_num[i], abs=0.05)
    assert sampled.expected_tau is not None and sampled.rounds > 0


def test_report_prefers_the_trained_candidate(tiny_target, corpus, trained, untrained, tmp_path):
    now = datetime.now(UTC)
    ids = evaluation_ids(len(corpus) + 2)
    recs = [record(ids[i], text(p), text(r), tenant="acme" if i % 2 else "globex",
                   domain="code" if i < 4 else None, now=now) for i, (p, r) in enumerate(corpus)]
    recs.append(record(ids[-2], text(corpus[0][0]), text(corpus[0][1]), temperature=0.7, now=now))
    recs.append(record(ids[-1], "5", "6", now=now))  # too short to replay: skipped
    res = evaluate_drafters(tiny_target, IdsTokenizer(), recs, ("2", trained), ("1", untrained),
                            target_id="tiny-llama", policy=PAPER_RULE, max_tokens=256, now=now)
    rep = EvaluationReport.model_validate(res.report.model_dump(mode="json"))
    assert res.skipped == 1 and rep.n_records == len(corpus) + 1 and rep.n_sampled == 1
    assert rep.candidate.tau > rep.champion.tau >= 1.0
    assert rep.candidate.expected_tau_sampled is not None
    assert set(rep.per_tenant) == {"acme", "globex"} and set(rep.per_domain) == {"code", "untagged", "chat"}
    assert rep.per_tenant["acme"].candidate_tau > rep.per_tenant["acme"].champion_tau
    assert len(rep.candidate.acceptance_by_position) == 7
    assert rep.candidate.acceptance_by_position[0] >= rep.candidate.acceptance_by_position[-1]
    cal = rep.candidate.calibration
    assert cal is not None and 0 <= cal.mae <= 1 and sum(b.count for b in cal.bins) > 0
    tput = {p.concurrency: p.tokens_per_s for p in rep.candidate.throughput}
    assert set(tput) == {1, 8, 32} and tput[32] > tput[1] > 0
    assert rep.candidate.verified_per_accepted >= 1.0 / 8
    plots = write_plots(rep, tmp_path / "plots")
    assert set(plots) == {"tau_per_tenant", "tau_per_domain", "reliability", "acceptance_by_position"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots.values())


def test_first_candidate_is_compared_with_plain_decoding(tiny_target, corpus, trained):
    ids = evaluation_ids(3)
    recs = [record(ids[i], text(p), text(r)) for i, (p, r) in enumerate(corpus[:3])]
    rep = evaluate_drafters(tiny_target, IdsTokenizer(), recs, ("1", trained), None, target_id="tiny-llama",
                            policy=PAPER_RULE, max_tokens=256).report
    assert rep.champion is None and rep.champion_version is None
    assert all(s.champion_tau == 1.0 for s in rep.per_tenant.values())


def test_window_selection(tmp_path):
    now = datetime(2026, 6, 1, tzinfo=UTC)
    held = evaluation_ids(6)
    train = evaluation_ids(2, held_out=False)
    recs = [record(held[0], "a", "b", now=now),
            record(held[0], "a", "b", now=now),  # duplicate
            record(held[1], "a", "b", tenant="short", age=timedelta(days=3), now=now),  # past its tenant TTL
            record(held[2], "a", "b", tenant="gone", now=now),  # opted out
            record(held[3], "a", "b", target_id="other", now=now),  # another target
            record(held[4], "a", "b", age=timedelta(days=29), now=now),
            record(held[5], "a", "b", age=timedelta(days=31), now=now),  # past the default TTL
            record(train[0], "a", "b", now=now), record(train[1], "a", "b", now=now)]  # training records
    path = tmp_path / "feedback.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in recs) + "not json\n")
    window = RecordsWindow(path=path)
    got = select_window(window.read(), now=now, target_id="tiny-llama", tenant_ttl_days={"short": 2},
                        default_ttl_days=30, opted_out=["gone"])
    assert [r.record_id for r in got] == [held[4], held[0]]  # oldest first
    assert [r.record_id for r in select_window(recs, now=now, target_id="tiny-llama", tenant_ttl_days={},
                                               default_ttl_days=30, max_records=1)] == [held[0]]


@pytest.mark.services
def test_kafka_window_reads_each_partitions_tail(tansu):
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import NewTopic

    from controlplane.shadow import KafkaFeedbackWindow

    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic("fb-test", num_partitions=2, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=tansu, acks="all")
    ids = evaluation_ids(30)
    for i, rid in enumerate(ids):
        producer.send("fb-test", record(rid, "p", "r").to_bytes(), partition=i % 2)
    producer.send("fb-test", b"{broken", partition=0)
    producer.flush()
    producer.close()
    window = KafkaFeedbackWindow(tansu, "fb-test", per_partition=6, timeout_s=20)
    got = [r.record_id for r in window.read()]
    # Partition 0 ends with ids 24, 26, 28 and the broken record; partition 1 with 19..29 odd.
    assert sorted(got) == sorted([ids[i] for i in (20, 22, 24, 26, 28)] + [ids[i] for i in (19, 21, 23, 25, 27, 29)])
    assert window.invalid == 1


def test_champion_replays_are_reused(tiny_target, corpus, trained, untrained):
    ids = evaluation_ids(4)
    recs = [record(ids[i], text(p), text(r)) for i, (p, r) in enumerate(corpus[:4])]
    cache: dict = {}
    first = evaluate_drafters(tiny_target, IdsTokenizer(), recs, ("2", trained), ("1", untrained),
                              target_id="tiny-llama", policy=PAPER_RULE, max_tokens=256, cache=cache).report
    assert len(cache) == 8
    again = evaluate_drafters(tiny_target, IdsTokenizer(), recs, ("3", trained), ("1", untrained),
                              target_id="tiny-llama", policy=PAPER_RULE, max_tokens=256, cache=cache).report
    assert len(cache) == 12 and again.champion.tau == first.champion.tau and again.candidate.tau == first.candidate.tau
