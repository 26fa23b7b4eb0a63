"""``adaflash bench adaptation`` on the tiny target: its tau is the engine's, and it writes its outputs."""

from __future__ import annotations

import json

# the learner's tiny target and drafter bundle (fixtures) and its drafter factory
from tests.learner.conftest import drafter_dir, make_drafter, target, target_dir  # noqa: F401 - fixtures


def _answers(target, tok, n, max_tokens, tmp_path):  # noqa: F811
    import promptsets as ds
    from bench.adaptation import answer

    prompts = ds.train_prompts("math", n, offset=500_000)
    return answer(target, tok, prompts, max_tokens, tmp_path / "answers.jsonl", "answers", concurrency=4)


def test_scored_tau_equals_the_engines_fixed_mode_tau(target, target_dir, tmp_path):  # noqa: F811
    """The bench scores tau by walking the target's greedy answer; serving the same prompts
    with the engine in mode fixed must realise exactly the same rounds."""
    from adaflash.config import DataplaneConfig, LearnerConfig
    from bench.adaptation import StepCost, score, supervise_trajectories
    from dataplane.engine import Engine
    from dataplane.sequence import SamplingParams, Sequence
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer
    from learner.supervision import Supervisor
    from learner.trainer import Trainer

    tok = Tokenizer(target_dir)
    identity = target_identity(target_dir)
    answered = _answers(target, tok, 4, 40, tmp_path)
    assert all(len(a.output_ids) > 5 for a in answered)
    # a drafter that accepts something: a few updates on the very answers it is scored on
    drafter = make_drafter(target, seed=3)
    sup = Supervisor(target, tok, identity, list(drafter.config.target_layers))
    sups = supervise_trajectories(sup, answered, tok, identity, "math")
    trainer = Trainer(drafter, sup, LearnerConfig(loss="hard", lr_drafter=3e-3, anchors_per_record=16, epochs=4))
    for step in range(1, 6):
        trainer.train_buffer(sups, step)
    drafter.eval().requires_grad_(False)
    k = drafter.config.block_size
    got = score(drafter, sups, StepCost([0.01 * (1 + m / k) for m in range(1, k + 1)], 0.002))

    eng = Engine(target, DataplaneConfig(mode="fixed", block_size=k, max_running=4), drafter, drafter_version="v",
                 eos_token_ids=[tok.eos_token_id])
    # the record's text drops a final EOS, so serve up to the token before it
    want = [a.output_ids[:-1] if a.output_ids[-1] == tok.eos_token_id else a.output_ids for a in answered]
    seqs = [Sequence(str(i), a.prompt_ids, params=SamplingParams(max_tokens=len(w)))
            for i, (a, w) in enumerate(zip(answered, want, strict=True))]
    for s in seqs:
        eng.add(s)
    eng.run_until_idle()
    assert [s.output_ids for s in seqs] == want
    assert [sp.tokens.tolist() for sp in sups] == [a.prompt_ids + w for a, w in zip(answered, want, strict=True)]
    rounds = sum(len(s.rounds) for s in seqs)
    accepted = sum(r.accepted for s in seqs for r in s.rounds)
    assert got["rounds"] == rounds
    assert got["tau"] == (accepted + rounds) / rounds
    assert got["tau"] > 1.0  # the test means something: drafts were accepted


def test_bench_cli_writes_result_and_plot(target_dir, drafter_dir, tmp_path, monkeypatch):  # noqa: F811
    from adaflash.cli import main

    monkeypatch.setenv("ADAFLASH_MODEL__PATH", str(target_dir))
    monkeypatch.setenv("ADAFLASH_MODEL__TARGET_ID", "tiny-llama")
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["bench", "adaptation", "--rounds", "2", "--records-per-round", "2", "--eval-prompts", "2",
               "--max-tokens", "16", "--tps-prompts", "1", "--tps-max-tokens", "6", "--drafter", str(drafter_dir),
               "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "result.json").read_text())
    assert set(r["curves"]) == {"frozen", "osd", "rkl", "opd"}
    assert all(len(rows) == 3 for rows in r["curves"].values())
    assert r["curves"]["opd"][0]["tau"] == r["curves"]["frozen"][0]["tau"]  # every method starts from the same drafter
    assert all(r["summary"][m]["engine_c1"]["identical_to_ar"] for m in ("frozen", "osd", "rkl", "opd"))
    assert (out / "plot.png").stat().st_size > 10_000
    assert r["eval_prompts"] == 2
    from adaflash.config import Settings
    from dataplane.runner import serving_precision

    # the engine and the step costs run at the precision nodes serve here, not the learner's float32
    assert r["served_precision"] == serving_precision(Settings()).torch_dtype.__str__().removeprefix("torch.")


def test_narrow_domains_stream_training_prompts_and_score_on_the_heldout_split():
    from promptsets import is_heldout
    from promptsets.narrow import NARROW_DOMAINS, OFFLINE_CHAT_END

    for nd in NARROW_DOMAINS.values():
        stream, held = nd.stream(20), nd.heldout(5)
        assert len(stream) == 20 and len(held) == 5
        index = {r["id"]: int(r["id"].rsplit("/", 1)[-1]) for r in stream + held}
        assert not any(is_heldout(nd.split_rule, index[r["id"]]) for r in stream)
        assert all(is_heldout(nd.split_rule, index[r["id"]]) for r in held)
        assert {r["id"] for r in stream}.isdisjoint(r["id"] for r in held)
        if nd.base == "chat" and nd.split_rule == "chat":  # ShareGPT streams: never what offline data reads
            assert min(index[r["id"]] for r in stream) >= OFFLINE_CHAT_END


def test_bench_cli_rejects_bad_input(capsys):
    from adaflash.cli import main

    assert main(["bench", "adaptation", "--domain", "poetry"]) != 0
    assert "unknown domain" in capsys.readouterr().err
    assert main(["bench", "adaptation", "--drafter", "/nonexistent"]) != 0


def test_answers_are_cached_per_prompt_across_counts(target, target_dir, tmp_path):  # noqa: F811
    """A longer run reuses the answers a shorter one (or an older per-count file) produced
    and generates only the missing prompts."""
    import promptsets as ds
    from bench.adaptation import _cache_file, answer
    from dataplane.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    prompts = ds.train_prompts("math", 4, offset=500_000)
    f = _cache_file(tmp_path, "tiny", "math", "stream", 12)
    legacy = f.parent / "math-stream-n1-t12.jsonl"
    f.parent.mkdir(parents=True)
    ds.write_jsonl([{"id": prompts[0]["id"], "output_ids": [7, 7, 7]}], str(legacy))
    two = answer(target, tok, prompts[:2], 12, f, "answers", concurrency=2)
    assert two[0].output_ids == [7, 7, 7]  # from the older per-count file, not regenerated
    assert len(two[1].output_ids) > 0
    rows = {r["id"]: r["output_ids"] for r in ds.read_jsonl(str(f))}
    assert rows == {prompts[0]["id"]: [7, 7, 7], prompts[1]["id"]: two[1].output_ids}
    ds.write_jsonl([{"id": prompts[1]["id"], "output_ids": [5]}, {"id": prompts[0]["id"], "output_ids": [7, 7, 7]}],
                   str(f))
    four = answer(target, tok, prompts, 12, f, "answers", concurrency=2)
    assert [a.output_ids for a in four[:2]] == [[7, 7, 7], [5]]  # cached rows win, in the prompts' order
    assert [a.prompt["id"] for a in four] == [p["id"] for p in prompts]
    assert len({r["id"] for r in ds.read_jsonl(str(f))}) == 4


def test_answers_more_prompts_than_a_tenant_may_queue(target, target_dir, tmp_path):  # noqa: F811
    """A stream longer than the admission's per-tenant queue (256 requests by default) is fed
    to the engine as requests finish, not refused at the 257th."""
    import promptsets as ds
    from adaflash.config import DataplaneConfig
    from bench.adaptation import answer
    from dataplane.tokenizer import Tokenizer

    limit = DataplaneConfig().tenant_max_queued
    prompts = ds.train_prompts("math", limit + 20, offset=500_000)
    out = answer(target, Tokenizer(target_dir), prompts, 2, tmp_path / "answers.jsonl", "answers", concurrency=8)
    assert [a.prompt["id"] for a in out] == [p["id"] for p in prompts]
    assert all(1 <= len(a.output_ids) <= 2 for a in out)
