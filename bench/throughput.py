"""``adaflash bench throughput``: TPS, tau and latency of ar / fixed / adaptive per concurrency.

``adaptive-budget`` (in --modes) runs adaptive with the cross-request verify budget
(``dataplane.policy: budget``) beside the per-request rule, in the same run.

All modes run on the same engine in one process, back to back, so the comparison is a
ratio against the strongest baseline of the same engine (our batched ``ar`` decoding,
itself checked against transformers ``generate``). Each (mode, concurrency, domain) run
keeps ``concurrency`` requests in flight (closed loop) until its requests are done.
Also measures the packed variable-length verify: N tokens spread over many requests
against one sequence of N tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from adaflash.config import Settings
from dataplane.spec_policy import PolicyConfig

DOMAINS = ("chat", "code", "math")


def load_prompts(path: str | None, per_domain: int) -> list[dict]:
    from promptsets import heldout_prompts, read_jsonl

    if path:
        rows = read_jsonl(path)
        bad = [i for i, r in enumerate(rows) if not isinstance(r.get("prompt"), str) or not r["prompt"].strip()]
        if bad:
            raise ValueError(f"{path}: rows {bad[:5]} have no non-empty 'prompt'")
        return [{"prompt": r["prompt"], "domain": r.get("domain") or "all"} for r in rows]
    return [r for d in DOMAINS for r in heldout_prompts(d, per_domain)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_closed_loop(engine, prompt_ids: list[list[int]], concurrency: int, max_tokens: int,
                    ignore_eos: bool = False) -> dict:
    """Keep ``concurrency`` requests in flight until all prompts are served; returns raw stats.

    ``step_ms_p50``: median time of an engine step that admitted no new request (a pure
    decode or verify step). ``outputs``: each request's tokens in the order the prompts
    were given (requests finish in another order from one mode to the next)."""
    from dataplane.sequence import SamplingParams, Sequence

    pending = list(enumerate(prompt_ids))
    live, done = [], []
    t0 = time.perf_counter()

    def submit():
        i, ids = pending.pop(0)
        s = Sequence(request_id=f"b{i}", prompt_ids=ids,
                     params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
        engine.add(s)
        live.append(s)

    while pending and len(live) < concurrency:
        submit()
    steps: list[float] = []
    while live:
        pure = engine._inbox.empty() and not engine.scheduler.waiting
        ts = time.perf_counter()
        engine.step()
        if pure:
            steps.append((time.perf_counter() - ts) * 1000)
        still = []
        for s in live:
            (done if s.finished_at is not None else still).append(s)
        live[:] = still
        while pending and len(live) < concurrency:
            submit()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in done)
    rounds = sum(len(s.rounds) for s in done)
    ttft = [(s.first_token_at - s.arrival) * 1000 for s in done]
    itl = [((s.finished_at - s.first_token_at) / (len(s.output_ids) - 1)) * 1000 for s in done
           if len(s.output_ids) > 1]
    verified = sum(r.k_hat for s in done for r in s.rounds)
    return {"wall_s": wall, "tokens": tokens, "tps": tokens / wall, "tau": (tokens - len(done)) / rounds if rounds else 0.0,
            "mean_k_hat": verified / rounds if rounds else 0.0, "ttft_ms_p50": _pct(ttft, 0.5),
            "ttft_ms_p99": _pct(ttft, 0.99), "itl_ms_p50": _pct(itl, 0.5), "itl_ms_p99": _pct(itl, 0.99),
            "step_ms_p50": _pct(steps, 0.5), "requests": len(done), "outputs": [s.output_ids for s in sorted(done, key=lambda s: int(s.request_id[1:]))],  # as submitted
            # (a_hat, accepted drafts, drafts verified) of every round that drafted: the head's calibration
            "head_samples": [(r.a_hat, r.accepted, r.k_hat - 1) for s in done for r in s.rounds if r.k_hat > 1]}


def head_calibration(samples: list[tuple[float, int, int]], cfg) -> dict:
    """The length head against what verification kept, per block position
    (``dataplane.spec_policy.position_ece``, the shadow report's measure)."""
    from dataplane import spec_policy as sp

    if not samples:
        return {"rounds": 0, "position_ece": [], "mean_ece": None}
    ece = sp.position_ece(samples, cfg)
    used = [e for i, e in enumerate(ece, start=1) if any(n >= i for _, _, n in samples)]
    return {"rounds": len(samples), "position_ece": [round(e, 4) for e in ece],
            "mean_ece": round(sum(used) / len(used), 4) if used else None,
            "mean_a_hat": round(sum(a for a, _, _ in samples) / len(samples), 4),
            "mean_kept_share": round(sum(acc / n for _, acc, n in samples) / len(samples), 4)}


MODE_ORDER = ["ar", "fixed", "adaptive", "adaptive-budget"]


def _engine(node, dp, mode: str, drafter, version, settings, tok):
    """``adaptive-budget``: adaptive with the cross-request verify budget (``dataplane.policy``)."""
    from dataplane.engine import Engine

    update = {"mode": "adaptive", "policy": "budget"} if mode == "adaptive-budget" else {"mode": mode}
    return Engine(node.target, dp.model_copy(update=update), drafter=drafter, drafter_version=version,
                  eos_token_ids=[tok.eos_token_id], max_model_len=settings.model.max_model_len)


def _drafter(node, drafter_dir: str | None):
    """``random``: a drafter of the starter's shape with random weights (one that never pays)."""
    from dataplane.drafter import new_drafter
    from dataplane.node import STARTER_DIR

    if drafter_dir != "random":
        return node.engine.drafter, node.engine.drafter_version
    kw = {"block_size": node.settings.dataplane.block_size}
    try:
        c = json.loads((STARTER_DIR / "config.json").read_text())
        if c.get("hidden_size") == node.target.args.hidden_size:
            kw = {"num_layers": c["num_layers"], "block_size": c["block_size"],
                  "n_target_layers": len(c["target_layers"])}
    except (OSError, ValueError, KeyError):
        pass
    return new_drafter(node.target, seed=0, **kw).prepare_serving(), "random"


def _aggregate(rows: list[dict], concurrency: list[int], modes: list[str]) -> None:
    """Rows of domain "all" per (mode, concurrency): every domain and repeat pooled; each row's
    ``speedup_vs_ar`` against ar of the same concurrency, domain and repeat (pooled rows: pooled ar)."""
    for c in concurrency:  # over domains and repeats
        for mode in modes:
            sub = [r for r in rows if r["mode"] == mode and r["concurrency"] == c and r["domain"] != "all"]
            tokens, wall = sum(r["tokens"] for r in sub), sum(r["wall_s"] for r in sub)
            rows.append({"mode": mode, "concurrency": c, "domain": "all", "wall_s": wall, "tokens": tokens,
                         "tps": tokens / wall if wall else 0.0, "tau": statistics.fmean(r["tau"] for r in sub),
                         "mean_k_hat": statistics.fmean(r["mean_k_hat"] for r in sub),
                         "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in sub),
                         "ttft_ms_p99": max(r["ttft_ms_p99"] for r in sub),
                         "itl_ms_p50": statistics.median(r["itl_ms_p50"] for r in sub),
                         "itl_ms_p99": max(r["itl_ms_p99"] for r in sub),
                         "step_ms_p50": statistics.median(r["step_ms_p50"] for r in sub),
                         "requests": sum(r["requests"] for r in sub)})
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["concurrency"] == r["concurrency"]
                   and x["domain"] == r["domain"] and x.get("repeat") == r.get("repeat")), None)
        r["speedup_vs_ar"] = r["tps"] / ar["tps"] if ar and ar["tps"] else None
    for r in rows:
        if r["domain"] == "all":
            r["speedup_spread"] = _spread(rows, r["mode"], r["concurrency"])


def _spread(rows: list[dict], mode: str, c: int) -> dict | None:
    """The speedup over ar of each repeat (all domains of that repeat pooled, against ar of the
    same repeat, which ran beside it): median, min, max. None with a single repeat."""
    reps = sorted({r["repeat"] for r in rows if r.get("repeat") is not None})
    if len(reps) < 2:
        return None
    per = []
    for k in reps:
        def tps(m, k=k):
            sub = [r for r in rows if r["mode"] == m and r["concurrency"] == c and r.get("repeat") == k]
            wall = sum(r["wall_s"] for r in sub)
            return sum(r["tokens"] for r in sub) / wall if wall else 0.0
        base = tps("ar")
        per.append(tps(mode) / base if base else 0.0)
    return {"repeats": len(per), "median": round(statistics.median(per), 4), "min": round(min(per), 4),
            "max": round(max(per), 4), "per_repeat": [round(x, 4) for x in per]}


def _baselines(node, dp, settings, tok, by_domain, max_tokens: int, llama_gguf: str | None) -> dict:
    """Our ar at C=1 against transformers (and llama.cpp) at the served precision, same prompts."""
    from bench.baselines import llama_cpp_available, llama_cpp_tps, transformers_tps

    sample = [ids for d in by_domain.values() for ids in d[:2]]
    eng = _engine(node, dp, "ar", None, None, settings, tok)
    run_closed_loop(eng, sample[:1], 1, 8)  # warm-up
    ours = run_closed_loop(eng, sample, 1, max_tokens, ignore_eos=True)["tps"]
    dtype = node.target.lm_head.weight.dtype
    hf = transformers_tps(node.target_dir, sample, max_tokens, dtype, tok.eos_token_id)
    out = {"precision": str(dtype).removeprefix("torch."), "prompts": len(sample), "ours_ar_tps": ours,
           "transformers_tps": hf, "ar_vs_transformers": ours / hf}
    if llama_gguf and llama_cpp_available():
        if llama_gguf == "auto":  # the packaged target re-written at the served precision, kept in the cache
            llama_gguf = str(_served_gguf(out["precision"]))
        lc = llama_cpp_tps(Path(llama_gguf), sample, max_tokens, torch.get_num_threads())
        out.update({"llama_cpp_gguf": Path(llama_gguf).name, "llama_cpp_tps": lc, "ar_vs_llama_cpp": ours / lc})
    else:
        out["llama_cpp_tps"] = None
    return out


def _served_gguf(precision: str) -> Path:
    """A GGUF of the packaged target at ``precision``, written once under the cache."""
    from adaflash.config import default_cache
    from bench.gguf_precision import packaged_gguf, write_at_precision

    path = default_cache() / "models" / f"SmolLM2-135M-Instruct.{precision}.gguf"
    if not path.is_file():
        write_at_precision(packaged_gguf(), path, precision)
    return path


def run(settings: Settings, prompts_path: str | None, modes: list[str], concurrency: list[int], max_tokens: int,
        drafter_dir: str | None, out: Path, per_domain: int = 10, min_requests: int = 4,
        compare_transformers: bool = True, llama_gguf: str | None = None, repeats: int = 1) -> dict:
    from bench.machine import bound_ms, describe, weight_bytes
    from bench.step_cost import forward_paths, packed_verify_cost, verify_cost_curve
    from dataplane.node import Node
    from dataplane.precision import BF16_FLAGS
    from dataplane.runner import serving_precision

    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(prompts_path, per_domain)
    dp = settings.dataplane.model_copy(update={"drafter": "" if drafter_dir == "random" else
                                               (drafter_dir or settings.dataplane.drafter)})
    settings.dataplane = dp
    machine = describe(serving_precision(settings))
    if drafter_dir == "random":  # the node loads no bundle; the bench builds the drafter
        settings.dataplane = dp.model_copy(update={"mode": "ar"})
    node = Node(settings)
    settings.dataplane = dp
    tok = node.tokenizer
    drafter, version = _drafter(node, drafter_dir)
    by_domain: dict[str, list[list[int]]] = {}
    for p in prompts:
        ids = tok.encode(tok.apply_chat([{"role": "user", "content": p["prompt"]}]))[: dp.max_prompt_tokens]
        by_domain.setdefault(p["domain"], []).append(ids)
    # One engine per mode for the whole run, as a node that stays up keeps its engine: its
    # policy state (calibration, back-off), measured cost curve and admission EMA carry from
    # one run to the next. Each is warmed up before its first measured run.
    engines: dict[str, object] = {}
    for mode in modes:
        engines[mode] = _engine(node, dp, mode, drafter, version, settings, tok)
        run_closed_loop(engines[mode], [ids[0] for ids in by_domain.values()], 2, 8)  # allocate, lay out
    rows, outputs, heads = [], {}, {m: [] for m in modes}
    # repeats go round every mode in turn, so a slow spell of a shared machine hits each mode alike
    jobs = [(m, c, d, k) for c in concurrency for k in range(repeats) for m in modes for d in by_domain]
    for mode, c, domain, k in tqdm(jobs, desc="throughput", unit="run"):
        ids = by_domain[domain]
        batch = [ids[i % len(ids)] for i in range(max(min_requests, c))]
        r = run_closed_loop(engines[mode], batch, c, max_tokens)
        outputs[(mode, c, domain, k)] = r.pop("outputs")
        heads[mode] += r.pop("head_samples")
        rows.append({"mode": mode, "concurrency": c, "domain": domain, "repeat": k, **r})
    _aggregate(rows, concurrency, modes)
    target_b = weight_bytes(node.target)
    draft_b = weight_bytes(drafter) if drafter is not None else 0  # its own; embed/lm_head are the target's
    bw = machine["read_bandwidth_gbs"]
    for r in rows:
        b = bound_ms(target_b + (max(draft_b, 0) if r["mode"] != "ar" else 0), bw)
        r["bound_ms"] = round(b, 3)
        r["step_over_bound"] = round(r["step_ms_p50"] / b, 3) if b else None
    # greedy outputs against ar's of the same repeat; by default they may differ at float near-ties
    # between batch shapes (README), so the share of identical answers is reported too
    pairs = [(o, outputs[("ar", c, d, k)]) for (m, c, d, k), o in outputs.items() if "ar" in modes and m != "ar"]
    same = [a == b for o, ref in pairs for a, b in zip(o, ref, strict=True)]
    lossless = all(same)
    result = {"machine": machine, "target": node.identity, "drafter_version": version, "max_tokens": max_tokens,
              "repeats": repeats,
              "weights_mb": {"target": round(target_b / 1e6, 1), "drafter_own": round(max(draft_b, 0) / 1e6, 1)},
              "rows": rows, "greedy_outputs_identical_to_ar": lossless,
              "greedy_identical_share": round(sum(same) / len(same), 4) if same else None,
              "verify_cost": verify_cost_curve(node.target), "packed_verify": packed_verify_cost(node.target),
              "cost_model": node.engine.cost.snapshot().model_dump(),
              "head_calibration": {m: head_calibration(heads[m], PolicyConfig.of(dp)) for m in modes if m != "ar"},
              "forward_paths": forward_paths(node.target_dir, any(f in machine["cpu_flags"] for f in BF16_FLAGS))}
    if compare_transformers and "ar" in modes:
        result["baselines"] = _baselines(node, dp, settings, tok, by_domain, max_tokens, llama_gguf)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "plot.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["domain"] == "all"]
    modes = sorted({r["mode"] for r in rows}, key=MODE_ORDER.index)
    cs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        tps = [next(r["tps"] for r in rows if r["mode"] == m and r["concurrency"] == c) for c in cs]
        sp = [next(r["speedup_vs_ar"] or 0 for r in rows if r["mode"] == m and r["concurrency"] == c) for c in cs]
        xs = [j + i * width for j in range(len(cs))]
        axes[0].bar(xs, tps, width, label=m)
        spread = [next(r.get("speedup_spread") for r in rows if r["mode"] == m and r["concurrency"] == c) for c in cs]
        err = None if None in spread else [[v - x["min"] for v, x in zip(sp, spread, strict=True)],
                                           [x["max"] - v for v, x in zip(sp, spread, strict=True)]]
        axes[1].bar(xs, sp, width, label=m, yerr=err, capsize=3)  # bars: pooled; whiskers: repeats' range
    for ax, title in ((axes[0], "tokens / s"), (axes[1], "speedup over ar")):
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(cs))], [f"C={c}" for c in cs])
        ax.set_title(title)
        ax.legend()
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    pv = result["packed_verify"]
    axes[2].plot([p["requests"] for p in pv], [p["ratio_to_one_sequence"] for p in pv], marker="o")
    axes[2].axhline(1.15, color="red", lw=0.8, ls="--", label="1.15x")
    axes[2].set_xscale("log", base=2)
    axes[2].set_title(f"packed verify of {pv[0]['tokens']} tokens vs one sequence")
    axes[2].set_xlabel("requests in the stream")
    axes[2].legend()
    for c in sorted({v["concurrency"] for v in result["verify_cost"]}):
        pts = [v for v in result["verify_cost"] if v["concurrency"] == c]
        axes[3].plot([v["tokens_per_request"] for v in pts], [v["ratio_to_one_token"] for v in pts], marker="o",
                     label=f"C={c}")
    axes[3].axhline(1.3, color="red", lw=0.8, ls="--", label="1.3x")
    axes[3].set_xscale("log", base=2)
    axes[3].set_title("verify cost: k tokens per request vs 1")
    axes[3].set_xlabel("tokens verified per request")
    axes[3].legend()
    m = result["machine"]
    flags = ",".join(f for f in m["cpu_flags"] if "bf16" in f or f == "avx2") or "-"
    fig.suptitle(f"{result['target']['id']} in {m['served_precision']} on {m['torch_threads']} threads [{flags}], "
                 f"{m['read_bandwidth_gbs']} GB/s; drafter {result['drafter_version']}, max_tokens "
                 f"{result['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
