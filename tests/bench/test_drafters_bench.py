"""``adaflash bench drafters`` on a tiny model: two bundles replayed by the shadow evaluation's
code on held-out answers, priced by a verify curve measured here."""

from __future__ import annotations

from adaflash.config import load_config
from tests.tiny_models import save_tiny_servable


def _tiny(tmp_path, real_target_dir):
    d = save_tiny_servable(tmp_path / "tiny", real_target_dir)
    settings = load_config(home=tmp_path / "home", cache=tmp_path / "cache")
    settings.model.path = str(d)
    settings.model.max_model_len = 512
    settings.dataplane.max_prompt_tokens = 400
    return d, settings


def test_bench_drafters_compares_bundles_by_acceptance_and_predicted_speedup(tmp_path, real_target_dir):
    from bench.drafters import run
    from dataplane.drafter import new_drafter
    from dataplane.drafter_io import save_bundle
    from dataplane.runner import ModelRunner

    d, settings = _tiny(tmp_path, real_target_dir)
    target = ModelRunner.reference().load_target(d)
    ident = {"id": "tiny", "sha256": "0" * 64}
    bundles = []
    for seed in (0, 1):
        path = tmp_path / f"drafter-{seed}"
        save_bundle(new_drafter(target, seed=seed, num_layers=1, block_size=4), path, ident, version=f"starter-{seed}",
                    lineage={"source": "offline"})
        bundles.append(str(path))
    res = run(settings, bundles, ["chat", "code"], 2, 8, tmp_path / "out")
    assert res["records"] == 4 and set(res["candidates"]) == set(bundles)
    for c in res["candidates"].values():
        assert set(c["domains"]) == {"chat", "code"} and c["draft_ms"] > 0
        for m in c["domains"].values():
            acc = m["acceptance_by_position"]
            assert m["records"] == 2 and len(acc) == 3 and all(0 <= p <= 1 for p in acc)
            assert abs(m["full_block_tau"] - (1 + sum(acc))) < 1e-3 and m["policy_tau"] >= 1.0
            assert set(m["predicted"]) == {"1", "8", "32"}
            assert all(p["tokens_per_s"] > 0 and p["speedup_vs_ar"] > 0 for p in m["predicted"].values())
        assert c["full_block_tau"] == {d: m["full_block_tau"] for d, m in c["domains"].items()}
    assert {p["batch"] for p in res["cost_curve"]["points"]} == {1, 8, 32}
    assert (tmp_path / "out" / "plot.png").stat().st_size > 10_000
    # the greedy answers are cached: a second run answers nothing again
    cache = list((tmp_path / "cache" / "bench" / "drafters").rglob("*.jsonl"))
    assert len(cache) == 1 and len(cache[0].read_text().splitlines()) == 4


def test_bench_drafters_refuses_bad_input(tmp_path, capsys):
    from adaflash.cli import main

    assert main(["bench", "drafters", str(tmp_path), "--domains", "poetry"]) != 0
    assert "unknown domain" in capsys.readouterr().err
    assert main(["bench", "drafters", str(tmp_path)]) != 0
    assert "not a drafter bundle" in capsys.readouterr().err
