"""``adaflash bench throughput``: TPS, tau and latency of ar / fixed / adaptive per concurrency.

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

DOMAINS = ("chat", "code", "math")


def load_prompts(path: str | None, per_domain: int) -> list[dict]:
    from adaflash.datasets import heldout_prompts, read_jsonl

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


def run_closed_loop(engine, prompt_ids: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Keep ``concurrency`` requests in flight until all prompts are served; returns raw stats."""
    from dataplane.sequence import SamplingParams, Sequence

    pending = list(enumerate(prompt_ids))
    live, done = [], []
    t0 = time.perf_counter()

    def submit():
        i, ids = pending.pop(0)
        s = Sequence(request_id=f"b{i}", prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens))
        engine.add(s)
        live.append(s)

    while pending and len(live) < concurrency:
        submit()
    while live:
        engine.step()
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
            "requests": len(done), "outputs": [s.output_ids for s in done]}


def transformers_baseline(target_dir: Path, prompt_ids: list[list[int]], max_tokens: int) -> float:
    """TPS of transformers ``generate`` (greedy, batch 1) on the same prompts."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tokens, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
            tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - t0)


def packed_verify_cost(target, n_tokens: int = 64, context: int = 128, splits=(1, 4, 8, 16), repeats: int = 3) -> list[dict]:
    """Time of one verify forward of ``n_tokens`` spread over B requests, relative to B = 1.

    Every request has ``context`` cached tokens. Repeats go round all splits in turn, so
    that a slow spell of a shared machine hits every split alike; each split's time is
    its fastest repeat.
    """
    g = torch.Generator().manual_seed(0)
    setups = []
    for b in splits:
        per = n_tokens // b
        kvs = []
        for _ in range(b):
            kv = target.new_cache(context + per + 1)
            target.forward_packed(torch.randint(3, 1000, (context,), generator=g), [0, context], [kv])
            kvs.append(kv)
        setups.append((b, per, kvs, torch.randint(3, 1000, (per * b,), generator=g), [i * per for i in range(b + 1)]))
    times: dict[int, list[float]] = {b: [] for b in splits}
    for _ in range(repeats):
        for b, _per, kvs, stream, cu in setups:
            for kv in kvs:
                kv.truncate(context)
            t0 = time.perf_counter()
            target.forward_packed(stream, cu, kvs)
            times[b].append(time.perf_counter() - t0)
    base = min(times[splits[0]])
    return [{"requests": b, "tokens": per * b, "seconds": min(times[b]), "ratio_to_one_sequence": min(times[b]) / base}
            for b, per, *_ in setups]


def run(settings: Settings, prompts_path: str | None, modes: list[str], concurrency: list[int], max_tokens: int,
        drafter_dir: str | None, out: Path, per_domain: int = 10, min_requests: int = 4,
        compare_transformers: bool = True) -> dict:
    from dataplane.engine import Engine
    from dataplane.node import Node

    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(prompts_path, per_domain)
    dp = settings.dataplane.model_copy(update={"drafter": drafter_dir or settings.dataplane.drafter})
    settings.dataplane = dp
    node = Node(settings)
    tok = node.tokenizer
    by_domain: dict[str, list[list[int]]] = {}
    for p in prompts:
        ids = tok.encode(tok.apply_chat([{"role": "user", "content": p["prompt"]}]))[: dp.max_prompt_tokens]
        by_domain.setdefault(p["domain"], []).append(ids)
    rows, outputs = [], {}
    jobs = [(m, c, d) for c in concurrency for m in modes for d in by_domain]
    for mode, c, domain in tqdm(jobs, desc="throughput", unit="run"):
        ids = by_domain[domain]
        n = max(min_requests, c)
        batch = [ids[i % len(ids)] for i in range(n)]
        engine = Engine(node.target, dp.model_copy(update={"mode": mode}), drafter=node.engine.drafter,
                        drafter_version=node.engine.drafter_version, eos_token_ids=[tok.eos_token_id],
                        max_model_len=settings.model.max_model_len)
        r = run_closed_loop(engine, batch, c, max_tokens)
        outputs[(mode, c, domain)] = r.pop("outputs")
        rows.append({"mode": mode, "concurrency": c, "domain": domain, **r})
    for c in concurrency:  # aggregate over domains
        for mode in modes:
            sub = [r for r in rows if r["mode"] == mode and r["concurrency"] == c and r["domain"] != "all"]
            tokens, wall = sum(r["tokens"] for r in sub), sum(r["wall_s"] for r in sub)
            rounds_tau = [r["tau"] for r in sub]
            rows.append({"mode": mode, "concurrency": c, "domain": "all", "wall_s": wall, "tokens": tokens,
                         "tps": tokens / wall if wall else 0.0, "tau": statistics.fmean(rounds_tau) if rounds_tau else 0,
                         "mean_k_hat": statistics.fmean(r["mean_k_hat"] for r in sub),
                         "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in sub),
                         "ttft_ms_p99": max(r["ttft_ms_p99"] for r in sub),
                         "itl_ms_p50": statistics.median(r["itl_ms_p50"] for r in sub),
                         "itl_ms_p99": max(r["itl_ms_p99"] for r in sub), "requests": sum(r["requests"] for r in sub)})
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["concurrency"] == r["concurrency"]
                   and x["domain"] == r["domain"]), None)
        r["speedup_vs_ar"] = r["tps"] / ar["tps"] if ar and ar["tps"] else None
    lossless = all(outputs[(m, c, d)] == outputs[("ar", c, d)] for (m, c, d) in outputs if "ar" in modes)
    result = {"target": node.identity, "drafter_version": node.engine.drafter_version, "max_tokens": max_tokens,
              "rows": rows, "greedy_outputs_identical_to_ar": lossless,
              "packed_verify": packed_verify_cost(node.target), "cost_model": node.engine.cost.snapshot(),
              "torch_threads": torch.get_num_threads()}
    if compare_transformers and "ar" in modes:
        sample = [ids for d in by_domain.values() for ids in d[:2]]
        eng = Engine(node.target, dp.model_copy(update={"mode": "ar"}), eos_token_ids=[tok.eos_token_id],
                     max_model_len=settings.model.max_model_len)
        ours = run_closed_loop(eng, sample, 1, max_tokens)["tps"]
        hf = transformers_baseline(node.target_dir, sample, max_tokens)
        result["ar_vs_transformers"] = {"ours_tps": ours, "transformers_tps": hf, "ratio": ours / hf}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "plot.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["domain"] == "all"]
    modes = sorted({r["mode"] for r in rows}, key=["ar", "fixed", "adaptive"].index)
    cs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        tps = [next(r["tps"] for r in rows if r["mode"] == m and r["concurrency"] == c) for c in cs]
        sp = [next(r["speedup_vs_ar"] or 0 for r in rows if r["mode"] == m and r["concurrency"] == c) for c in cs]
        xs = [j + i * width for j in range(len(cs))]
        axes[0].bar(xs, tps, width, label=m)
        axes[1].bar(xs, sp, width, label=m)
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
    fig.suptitle(f"{result['target']['id']}, drafter {result['drafter_version']}, max_tokens {result['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
