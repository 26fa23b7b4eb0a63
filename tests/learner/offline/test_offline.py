"""Offline data preparation, training, resume and held-out evaluation on a tiny target."""

import json

import pytest
import torch

from learner import data as D
from learner import offline as O


def _prepare(tiny_target, tok, root):
    streams = [D.StreamSpec("tf", "math", 4, 512), D.StreamSpec("regen", "math", 3, 512, max_new_tokens=12)]
    return D.prepare(tiny_target, tok, root, streams, max_shards=2, progress=False)


def _short_run(**over) -> O.TrainConfig:
    """A few steps of a one-layer drafter on the tiny target's math shards, no validation."""
    return O.TrainConfig(**{"num_layers": 1, "target_layers": [1, 3], "draft_vocab_size": 64, "head_hidden": 16,
                            "lr": 3e-3, "seqs_per_step": 2, "anchors_per_seq": 4, "val_every": 0, "eval_prompts": 0,
                            "domains": ["math"], "vocab_prior": False, "max_shard_seqs_val": 0, "rescan_every": 0,
                            "streams": [], "domain_weights": {}, **over})


def test_shards_resumable_and_labelled(tiny_target, tok, tmp_path):
    res = _prepare(tiny_target, tok, tmp_path)
    assert res["shards"] == {"tf-math": 2, "regen-math": 2}
    paths = D.list_shards(tmp_path)
    mtimes = [p.stat().st_mtime_ns for p in paths]
    again = _prepare(tiny_target, tok, tmp_path)  # nothing recomputed
    assert again["tokens"] == res["tokens"]
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    ex = D.load_shard(paths[0])[0]
    layers = D.store_layers(4)
    assert ex.hidden.dtype == torch.float16 and ex.hidden.shape == (len(ex.tokens), len(layers), 64)
    # labels are the target's top-1 after each position
    out = tiny_target.forward_packed(ex.tokens, [0, len(ex.tokens)], [tiny_target.new_cache(len(ex.tokens) + 1)],
                                     hidden_layers=layers)
    assert torch.equal(out.logits.argmax(-1), ex.labels)
    assert torch.allclose(out.hidden.half().float(), ex.hidden.float(), atol=1e-2)
    # regenerated answers are the target's greedy tokens: label after t-1 == token t
    rg = [e for p in paths if "regen" in str(p) for e in D.load_shard(p)]
    e = rg[0]
    assert torch.equal(e.labels[e.resp_start - 1:-1], e.tokens[e.resp_start:])
    s = D.summary(tmp_path)
    assert s["tf-math"]["shards"] == 2 and s["regen-math"]["sequences"] == 6


def test_make_targets_indices_and_masks():
    L, k = 12, 4
    toks = torch.arange(100, 100 + L)
    labels = toks.roll(-1).clone()  # target agrees with the text everywhere ...
    labels[6] = 7  # ... except after position 6
    ex = D.Example(toks, labels, torch.zeros(L, 1, 8, dtype=torch.float16), 2, "chat", "tf")
    anchors = torch.tensor([4, 9])
    lab, valid, inv = O.make_targets(ex, anchors, k, None, consistent=True)
    assert lab[0].tolist() == [labels[3], labels[4], labels[5], labels[6]]
    assert valid[0].tolist() == [False, True, True, True]
    lab2, valid2, _ = O.make_targets(ex, torch.tensor([5]), k, None, consistent=True)
    # block at 5: positions predict labels[5], labels[6], labels[7]; text token 7 != labels[6]
    assert valid2[0].tolist() == [False, True, True, False]
    assert valid[1].tolist() == [False, True, True, True]  # label index 9+3-1 = 11 = L-1 is still valid
    _, v3, _ = O.make_targets(ex, torch.tensor([10]), k, None, consistent=True)
    assert v3[0].tolist() == [False, True, True, False]
    vi = torch.full((300,), -1, dtype=torch.int64)
    vi[labels[3]] = 0
    _, _, inv = O.make_targets(ex, anchors, k, vi, consistent=False)
    assert inv[0].tolist() == [True, False, False, False]  # only labels[3] is in the vocabulary


def test_position_weights_and_lr():
    w = O.position_weights(16, 7.0)
    assert w[0] == 0 and abs(float(w[1]) - 1) < 1e-6 and bool((w[2:] < w[1:-1]).all())
    cfg = O.TrainConfig(steps=100, warmup=10, min_lr_ratio=0.1)
    assert O.lr_at(0, cfg) == 0.1 and abs(O.lr_at(10, cfg) - 1) < 1e-6 and abs(O.lr_at(100, cfg) - 0.1) < 1e-6


def test_train_resume_bundle_and_eval(tiny_target, tok, tmp_path):
    root = tmp_path / "data"
    _prepare(tiny_target, tok, root)
    cfg = O.TrainConfig(num_layers=1, target_layers=[1, 3], draft_vocab_size=64, head_hidden=16, steps=40,
                        lr=3e-3, warmup=5, seqs_per_step=2, anchors_per_seq=4, val_every=20, eval_prompts=2,
                        eval_max_tokens=12, domains=["math"], vocab_prior=False, max_shard_seqs_val=0, rescan_every=0,
                        streams=[], domain_weights={})
    out = tmp_path / "run"
    ident = {"id": "tiny", "sha256": "0" * 64}
    res = O.train(tiny_target, tok, tmp_path, root, out, cfg, progress=False, target_identity=ident)
    assert res["steps"] == 40
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["type"] == "train"]
    # each logged loss is one step of two sequences: noisy; on average below the first one
    assert sum(losses[1:]) / len(losses[1:]) < losses[0]
    assert (out / "loss.png").exists() and (out / "tau.png").exists()
    ev = res["heldout_tau"]
    assert set(ev["domains"]) == {"chat", "code", "math"} and all(r["tau"] >= 1 for r in ev["domains"].values())
    # resume: a longer run continues from step 40
    # resume with a longer schedule and a narrower data mix (a logged curriculum phase)
    cfg2 = O.TrainConfig(**{**cfg.__dict__, "steps": 50, "streams": ["regen-math"], "domain_weights": {"math": 1.0}})
    bad = O.TrainConfig(**{**cfg.__dict__, "lr": 1.0})
    with pytest.raises(RuntimeError, match="lr"):
        O.train(tiny_target, tok, tmp_path, root, out, bad, progress=False, target_identity=ident)
    res2 = O.train(tiny_target, tok, tmp_path, root, out, cfg2, progress=False, target_identity=ident)
    assert res2["steps"] == 50
    steps = [r["step"] for r in (json.loads(x) for x in (out / "log.jsonl").read_text().splitlines())
             if r["type"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 50 and steps.count(40) == 1
    from dataplane.drafter_io import load_bundle

    d, man = load_bundle(out / "bundle", tiny_target, ident)
    assert d.config.draft_vocab_size == 64 and man.training["steps"] == 50
    assert man.training["seed"] == 0 and "compute" in man.training and man.lineage.source == "offline"
    starts = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"start"' in x]
    assert [r["step"] for r in starts] == [0, 40] and starts[1]["streams"] == ["regen-math"]
    assert [p["step"] for p in man.training["phases"]] == [0, 40]


def test_eval_identical_to_ar(tiny_target, tok):
    from learner.offline_eval import evaluate

    cfg = O.TrainConfig(num_layers=1, target_layers=[1, 3], draft_vocab_size=0, head_hidden=8)
    d = O.build_drafter(tiny_target, cfg).eval().requires_grad_(False)
    res = evaluate(tiny_target, tok, d, n=2, max_tokens=10, domains=("math", "code"), check_ar=True)
    assert all(r["identical_to_ar"] for r in res["domains"].values())
    assert res["domains"]["math"]["n"] == 2


def test_bigram_init_is_what_the_drafter_computes(tiny_target, tok, tmp_path):
    from learner.offline_init import bigram_counts, fit_bigram

    _prepare(tiny_target, tok, tmp_path)
    exs = [e for p in D.list_shards(tmp_path) for e in D.load_shard(p, [0, 1])]
    cfg = O.TrainConfig(num_layers=2, target_layers=[1, 3], draft_vocab_size=0, head_hidden=8)
    d = O.build_drafter(tiny_target, cfg)
    pairs = bigram_counts(exs)
    st = fit_bigram(d, tiny_target, pairs)
    assert st["fit_acc"] <= st["table_acc"] and st["fit_acc"] > 0.05
    # the drafter's position-1 greedy tokens are the fit's predictions, whatever the context
    hits = total = 0
    with torch.no_grad():
        for e in exs:
            anchors = torch.arange(e.resp_start, len(e.tokens) - 1)
            h = d.forward_train(e.hidden.float(), e.tokens, anchors)
            pred = d.logits(h[:, 1]).argmax(-1)
            hits += int((pred == e.labels[anchors]).sum())
            total += len(anchors)
    assert abs(hits / total - st["fit_acc"]) < 0.02


def test_a_run_continues_from_a_bundle_and_refuses_another_shape(tiny_target, tok, tmp_path):
    root = tmp_path / "data"
    _prepare(tiny_target, tok, root)
    cfg = _short_run(steps=5, warmup=1)
    ident = {"id": "tiny", "sha256": "0" * 64}
    O.train(tiny_target, tok, tmp_path, root, tmp_path / "first", cfg, progress=False, target_identity=ident)
    from dataplane.drafter_io import load_bundle

    src, _ = load_bundle(tmp_path / "first" / "bundle", tiny_target, ident)
    # steps=0: the continued run's bundle is the source's weights and draft vocabulary, not a fresh start
    cont = O.TrainConfig(**{**cfg.__dict__, "steps": 0, "init_bundle": str(tmp_path / "first" / "bundle")})
    O.train(tiny_target, tok, tmp_path, root, tmp_path / "second", cont, progress=False, target_identity=ident)
    got, man = load_bundle(tmp_path / "second" / "bundle", tiny_target, ident)
    assert man.version == "starter-1" and man.lineage.parent_version == "starter-0"
    assert torch.equal(got.vocab_map, src.vocab_map)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), src.state_dict().values(), strict=True))
    fresh = O.TrainConfig(**{**cfg.__dict__, "steps": 0})
    O.train(tiny_target, tok, tmp_path, root, tmp_path / "fresh", fresh, progress=False, target_identity=ident)
    other, _ = load_bundle(tmp_path / "fresh" / "bundle", tiny_target, ident)
    assert not torch.equal(other.fc.weight, src.fc.weight)  # what a fresh start would have been
    wrong = O.TrainConfig(**{**cont.__dict__, "draft_vocab_size": 32})
    with pytest.raises(RuntimeError, match="draft_vocab_size"):
        O.train(tiny_target, tok, tmp_path, root, tmp_path / "third", wrong, progress=False, target_identity=ident)
    # a run may add the recent-feature input: it starts at zero, so the drafter computes what it did
    grown = O.TrainConfig(**{**cont.__dict__, "recent_input": True})
    O.train(tiny_target, tok, tmp_path, root, tmp_path / "grown", grown, progress=False, target_identity=ident)
    big, _ = load_bundle(tmp_path / "grown" / "bundle", tiny_target, ident)
    assert big.config.recent_input and not big.recent_proj.weight.any()
    ex = D.load_shard(D.list_shards(root)[0], [0, 1])[0]
    anchors = torch.tensor([ex.resp_start, len(ex.tokens) - 3])
    with torch.no_grad():
        assert torch.allclose(big.forward_train(ex.hidden.float(), ex.tokens, anchors),
                              src.forward_train(ex.hidden.float(), ex.tokens, anchors))
    # ... and a bundle with it is never continued without it
    back = O.TrainConfig(**{**cont.__dict__, "init_bundle": str(tmp_path / "grown" / "bundle")})
    with pytest.raises(RuntimeError, match="recent-feature input"):
        O.train(tiny_target, tok, tmp_path, root, tmp_path / "fourth", back, progress=False, target_identity=ident)


def test_cli_budget_in_hours_and_resume_needs_a_checkpoint(tmp_path, capsys):
    import argparse

    from adaflash.cli import main
    from adaflash.config import load_config
    from learner.offline_cli import register, training_config

    assert main(["train-offline", "--out", str(tmp_path / "none"), "--resume"]) != 0
    assert "--resume: no checkpoint" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train-offline", "--budget-hours", "1.5", "--init-bundle", "dataplane/starter"])
    cfg = training_config(args, load_config(home=tmp_path / "home"))
    assert cfg.time_budget_s == 5400.0 and cfg.init_bundle == "dataplane/starter"
    assert main(["train-offline", "--out", str(tmp_path / "x"), "--matmul-precision", "float8"]) != 0
    assert "--matmul-precision: Input should be" in capsys.readouterr().err  # a message, not a traceback


def test_offline_chat_data_never_takes_what_the_narrow_streams_take():
    from promptsets.narrow import NARROW_DOMAINS, OFFLINE_CHAT_END, offline_chat

    spec = D.StreamSpec("tf", "chat", 48, 512)
    items = [it for i in range(60) for it in D._items(spec, i)]
    index = [int(it["id"].rsplit("/", 1)[-1]) for it in items]
    assert index and max(index) >= OFFLINE_CHAT_END  # past the narrow streams' start ...
    late = [it["prompt"].lower() for it, j in zip(items, index, strict=True) if j >= OFFLINE_CHAT_END]
    assert late and not any("python" in p or "javascript" in p for p in late)  # ... only off their topics
    streamed = [r for nd in NARROW_DOMAINS.values() if nd.base == "chat" for r in nd.stream(50)]
    shared = [r for r in streamed if r["id"].startswith("sharegpt/")]
    assert shared and not any(offline_chat(r) for r in shared)
    streamed = {r["id"] for r in streamed}
    offline = {it["id"] for i in range(60) for kind in ("tf", "regen")
               for it in D._items(D.StreamSpec(kind, "chat", 48, 512), i)}
    assert streamed and not streamed & offline


def test_sample_streams_cycle_the_prompts_with_new_seeds(tiny_target, tok, tmp_path):
    spec = D.StreamSpec("sample", "code", 40, 512, max_new_tokens=10, passes=2)
    shards = [D._items(spec, i) for i in range(7)]
    assert all(shards[:6]) and shards[6] == []  # 120 training tasks, two passes of three shards
    first, again = shards[0], shards[3]  # the same prompts on the second pass ...
    assert [it["prompt"] for it in first] == [it["prompt"] for it in again]
    assert all(a["seed"] != b["seed"] for a, b in zip(first, again, strict=True))  # ... with new seeds
    assert len({it["id"] for s in shards for it in s}) == 240
    small = D.StreamSpec("sample", "code", 3, 4096, max_new_tokens=10, max_prompt_tokens=4096)  # byte tokens
    meta = D.build_shard(tiny_target, tok, small, 0, tmp_path, D.store_layers(4))
    assert meta["kind"] == "sample" and meta["precision"] == "float32"
    greedy = D.generate(tiny_target, tok, [it["prompt"] for it in D._items(small, 0)], 10)
    rows = [json.loads(x) for x in (tmp_path / "sample-code" / "gen-00000.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in rows] != greedy  # sampled, not the greedy answers
    ex = D.load_shard(D.shard_path(tmp_path, "sample-code", 0))[0]
    # trained like teacher-forced text: a block stops counting where the text leaves the greedy path
    anchors = torch.tensor([ex.resp_start])
    _, masked, _ = O.make_targets(ex, anchors, 8, None, consistent=True)
    _, unmasked, _ = O.make_targets(ex, anchors, 8, None, consistent=False)
    off = (ex.tokens[ex.resp_start + 1:ex.resp_start + 7] != ex.labels[ex.resp_start:ex.resp_start + 6]).any()
    assert bool(off) == (masked.sum() < unmasked.sum())


def test_bfloat16_products_train_and_auto_follows_the_served_precision(tiny_target, tok, tmp_path):
    from adaflash.config import Settings
    from dataplane.runner import serving_precision

    root = tmp_path / "data"
    _prepare(tiny_target, tok, root)
    cfg = _short_run(steps=12, warmup=2, matmul_precision="bfloat16")
    ident = {"id": "tiny", "sha256": "0" * 64}
    res = O.train(tiny_target, tok, tmp_path, root, tmp_path / "run", cfg, progress=False, target_identity=ident)
    assert res["compute"]["matmul_precision"] == "bfloat16"
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()
              if '"train"' in x]
    assert losses and all(0 < v < 100 for v in losses)
    served = serving_precision(Settings(), "cpu").torch_dtype
    want = torch.bfloat16 if served == torch.bfloat16 else torch.float32
    assert O.matmul_dtype(O.TrainConfig(matmul_precision="auto")) == want
    assert O.matmul_dtype(O.TrainConfig()) == torch.float32
