"""``adaflash bench throughput`` end to end on a tiny model: the figures it must report exist."""

from __future__ import annotations

from adaflash.config import load_config
from tests.tiny_models import save_tiny_servable


def test_bench_throughput_reports_machine_bound_and_verify_curve(tmp_path, real_target_dir):
    from bench.throughput import run

    d = save_tiny_servable(tmp_path / "tiny", real_target_dir)
    settings = load_config(home=tmp_path / "home")
    settings.model.path = str(d)
    settings.model.max_model_len = 512
    settings.dataplane.max_prompt_tokens = 64
    result = run(settings, None, ["ar", "adaptive"], [1, 2], 4, "random", tmp_path / "out", per_domain=1,
                 min_requests=2, compare_transformers=True, repeats=2)
    m = result["machine"]
    assert m["read_bandwidth_gbs"] > 0 and m["served_precision"] in ("float32", "bfloat16")
    assert isinstance(m["cpu_flags"], list) and m["torch_threads"] >= 1
    rows = [r for r in result["rows"] if r["domain"] == "all"]
    assert {(r["mode"], r["concurrency"]) for r in rows} == {("ar", 1), ("ar", 2), ("adaptive", 1), ("adaptive", 2)}
    assert all(r["bound_ms"] > 0 and r["step_ms_p50"] > 0 and r["step_over_bound"] > 0 for r in rows)
    # two repeats taking turns: each pooled row gives the spread of its per-repeat speedups
    assert 0.0 <= result["greedy_identical_share"] <= 1.0
    assert result["repeats"] == 2 and all(len([x for x in result["rows"] if x["domain"] != "all" and
                                              (x["mode"], x["concurrency"]) == (r["mode"], r["concurrency"])])
                                         == 2 * len({x["domain"] for x in result["rows"]} - {"all"}) for r in rows)
    for r in rows:
        sp = r["speedup_spread"]
        assert sp["repeats"] == 2 and sp["min"] <= sp["median"] <= sp["max"] and len(sp["per_repeat"]) == 2
        assert r["mode"] != "ar" or sp["per_repeat"] == [1.0, 1.0]
    curve = {(v["concurrency"], v["tokens_per_request"]) for v in result["verify_cost"]}
    assert curve == {(c, n) for c in (1, 16) for n in (1, 2, 4, 8, 16)}
    assert result["drafter_version"] == "random" and result["weights_mb"]["drafter_own"] > 0
    b = result["baselines"]
    assert b["precision"] == m["served_precision"] and b["transformers_tps"] > 0 and b["ar_vs_transformers"] > 0
    paths = {(p["precision"], p["path"], p["tokens"]) for p in result["forward_paths"]}
    assert ("float32", "module reference", 1) in paths and ("float32", "fused", 16) in paths
    assert (tmp_path / "out" / "result.json").is_file() and (tmp_path / "out" / "plot.png").stat().st_size > 0
    hc = result["head_calibration"]
    assert set(hc) == {"adaptive"} and hc["adaptive"]["rounds"] >= 0
    assert hc["adaptive"]["rounds"] == 0 or len(hc["adaptive"]["position_ece"]) == settings.dataplane.block_size - 1


def test_head_calibration_per_block_position():
    from adaflash.config import DataplaneConfig
    from bench.throughput import head_calibration
    from dataplane.spec_policy import PolicyConfig

    cfg = PolicyConfig.of(DataplaneConfig(block_size=4))
    assert head_calibration([], cfg) == {"rounds": 0, "position_ece": [], "mean_ece": None}
    # a head that says "everything is kept" while verification keeps nothing is off by ~1 at every position
    wrong = head_calibration([(0.999, 0, 3)] * 20, cfg)
    assert wrong["rounds"] == 20 and len(wrong["position_ece"]) == 3 and wrong["mean_ece"] > 0.9
    assert wrong["mean_a_hat"] == 0.999 and wrong["mean_kept_share"] == 0.0
    # ... and one that says so when verification keeps everything is right
    right = head_calibration([(0.999, 3, 3)] * 20, cfg)
    assert right["mean_ece"] < 0.05


def test_closed_loop_outputs_come_in_the_order_of_the_prompts(tiny_target):
    """Requests finish in another order from one mode to the next (short answers first): the
    outputs that the lossless comparison pairs up must follow the prompts, not the finish."""
    from bench.throughput import run_closed_loop
    from tests.dataplane.engine_util import make_engine, run

    lengths = [10, 253, 12, 251, 8]  # the long prompts reach the context limit (256) within a few tokens
    prompts = [[3 + (i + j) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    alone = [run(make_engine(tiny_target, mode="ar"), [p], max_tokens=6)[0].output_ids for p in prompts]
    engine = make_engine(tiny_target, mode="ar")
    got = run_closed_loop(engine, prompts, 3, 6)
    assert [len(o) for o in alone] == [6, 3, 6, 5, 6]
    assert got["requests"] == len(prompts) and got["outputs"] == alone
