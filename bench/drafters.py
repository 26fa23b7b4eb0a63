"""``adaflash bench drafters``: compare drafter bundles as the control plane would judge them.

Each candidate is replayed by the shadow evaluation's own code
(``controlplane.shadow.aggregate.evaluate_drafters``) on the target's greedy answers to
held-out prompts (``promptsets`` held-out split, per domain; answers cached on disk), with
the speculation policy nodes run (``PolicyConfig.of(settings.dataplane)``) and a cost curve
measured on this machine: the target's verify time for 1-16 tokens per request at
concurrency 1, 8 and 32 (``bench.step_cost``) and the candidate's own drafter pass. So a
candidate's figures are its measured per-position acceptance and the speedup the cost
model predicts from it, at the served precision:

per domain (one replay each):

- ``full_block_tau``: greedy accepted length when every round drafts the full block
  (1 + the sum of ``acceptance_by_position``, P(draft i accepted));
- ``policy_tau``: accepted length of the rounds the node's policy would run;
- ``predicted``: tokens/s of the policy's walk at concurrency 1, 8 and 32, against plain
  decoding priced by the same curve (``speedup_vs_ar``).

Writes result.json and plot.png (acceptance by position, predicted speedup).
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

import promptsets as ds
from adaflash.config import Settings

VERIFY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def measured_cost(target, concurrency=(1, 8, 32), lengths=VERIFY_LENGTHS, repeats: int = 3):
    """A cost model whose table holds this machine's verify step times (batch, total tokens)."""
    from bench.step_cost import verify_cost_curve
    from dataplane.cost_model import CostModel

    cost = CostModel()
    for row in verify_cost_curve(target, concurrency=concurrency, lengths=lengths, repeats=repeats):
        c = row["concurrency"]
        cost.set_point(c, c * row["tokens_per_request"], row["ms"] / 1e3)
    return cost


def heldout(domains: list[str], n: int, tok, max_prompt_tokens: int) -> list[dict]:
    from learner.offline_eval import heldout_encoded

    return [p for dom in domains for p, _ in heldout_encoded(tok, dom, n, max_prompt_tokens)]


def run(settings: Settings, bundles: list[str], domains: list[str], n: int, max_tokens: int, out: Path) -> dict:
    from bench.adaptation import answer, to_record
    from bench.machine import describe
    from bench.step_cost import drafter_pass_s
    from controlplane.shadow.aggregate import ar_throughput, evaluate_drafters
    from dataplane.cost_model import CostModel
    from dataplane.drafter_io import load_bundle
    from dataplane.runner import ModelRunner, serving_precision
    from dataplane.spec_policy import PolicyConfig
    from dataplane.target_cache import ensure_target, target_identity
    from dataplane.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    d = ensure_target(settings)
    runner = ModelRunner.serving(settings)
    target, tok, identity = runner.load_target(d), Tokenizer(d), target_identity(d)
    prompts = heldout(domains, n, tok, settings.dataplane.max_prompt_tokens)
    cache = Path(settings.cache) / "bench" / "drafters" / identity["id"] / f"heldout-t{max_tokens}.jsonl"
    answered = answer(target, tok, prompts, max_tokens, cache, "greedy answers")
    records = [to_record(a, tok, identity, "eval", a.prompt["domain"]) for a in answered]
    cost = measured_cost(target)
    ar = ar_throughput(cost)
    policy = PolicyConfig.of(settings.dataplane)
    candidates = {}
    for path in tqdm(bundles, desc="candidates", unit="drafter"):
        drafter, man = load_bundle(path, target, identity)
        drafter = runner.place(drafter)
        own = CostModel.from_snapshot(cost.snapshot())  # the machine's verify curve, this drafter's own pass
        own.draft_per_request_s = drafter_pass_s(target, drafter, answered[0].prompt_ids)
        by_domain = {}
        for dom in domains:  # one replay per domain: its acceptance per position and full-block tau
            recs = [r for r in records if r.domain == dom]
            rep = evaluate_drafters(target, tok, recs, (man.version, drafter), None, target_id=identity["id"],
                                    policy=policy, max_tokens=settings.model.max_model_len, cost=own,
                                    cost_source="measured here").report
            by_domain[dom] = _metrics(rep.candidate, ar, len(recs))
        candidates[str(path)] = {
            "version": man.version, "draft_ms": round(own.draft_per_request_s * 1e3, 3),
            "weights_mb": round(sum(p.numel() * p.element_size() for p in drafter.parameters()) / 1e6, 1),
            "full_block_tau": {d: m["full_block_tau"] for d, m in by_domain.items()},
            "domains": by_domain,
        }
    result = {"machine": describe(serving_precision(settings)), "target": identity, "domains": domains,
              "prompts": len(prompts), "max_tokens": max_tokens, "records": len(records),
              "cost_curve": cost.snapshot().model_dump(), "ar_tokens_per_s": {str(k): round(v, 2) for k, v in ar.items()},
              "candidates": candidates}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "plot.png")
    return result


def _metrics(c, ar: dict, n_records: int) -> dict:
    """One domain's figures of a candidate (``DrafterMetrics`` of its replay)."""
    from adaflash.contracts.evaluation import THROUGHPUT_CONCURRENCIES

    predicted = {p.concurrency: p for p in c.throughput}
    acc = [round(x, 4) for x in c.acceptance_by_position]
    return {"records": n_records,
            # greedy accepted length when every round drafts the full block: 1 + sum_i P(draft i accepted)
            "full_block_tau": round(1.0 + sum(c.acceptance_by_position), 4),
            "policy_tau": round(c.tau, 4), "acceptance_by_position": acc,
            "predicted": {str(k): {"tokens_per_s": round(predicted[k].tokens_per_s, 2),
                                   "speedup_vs_ar": round(predicted[k].tokens_per_s / ar[k], 4)}
                          for k in THROUGHPUT_CONCURRENCIES},
            "head_position_ece": [round(x, 4) for x in (c.calibration.position_ece if c.calibration else [])]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    series = [(f"{name} {dom} (tau {m['full_block_tau']:.2f})", m) for name, c in result["candidates"].items()
              for dom, m in c["domains"].items()]
    width = 0.8 / max(1, len(series))
    cs = list(series[0][1]["predicted"]) if series else []
    for i, (label, m) in enumerate(series):
        a.plot(range(1, len(m["acceptance_by_position"]) + 1), m["acceptance_by_position"], marker="o", label=label)
        b.bar([j + i * width for j in range(len(cs))], [m["predicted"][k]["speedup_vs_ar"] for k in cs], width,
              label=label)
    a.set_title("P(draft i accepted), held-out greedy answers")
    a.set_xlabel("block position i")
    a.legend(fontsize=7)
    b.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(cs))], [f"C={k}" for k in cs])
    b.axhline(1.0, color="grey", lw=0.8, ls="--")
    b.set_title("predicted speedup over ar (measured cost curve, node policy)")
    b.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"{result['target']['id']} in {m['served_precision']}; {result['records']} held-out answers "
                 f"({', '.join(result['domains'])}), {result['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register_bench(bsub) -> None:
    p = bsub.add_parser("drafters", help="compare drafter bundles: held-out acceptance per position and the "
                                         "speedup the measured cost curve predicts (the shadow evaluation's replay)")
    p.add_argument("bundles", nargs="+", help="drafter bundle directories")
    p.add_argument("--domains", default="chat,code", help="held-out domains (comma-separated)")
    p.add_argument("--n", type=int, default=30, help="held-out prompts per domain")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of each greedy answer")
    p.add_argument("--out", default="out/bench-drafters")
    p.set_defaults(func=_cli)


def _cli(args, settings) -> int:
    from adaflash.cli import CliError

    domains = [x for x in args.domains.split(",") if x]
    bad = [x for x in domains if x not in ds.DOMAINS]
    if bad or not domains:
        raise CliError(f"unknown domain(s) {bad or domains}; choose from {', '.join(ds.DOMAINS)}")
    missing = [b for b in args.bundles if not (Path(b) / "manifest.json").is_file()]
    if missing:
        raise CliError(f"not a drafter bundle (no manifest.json): {', '.join(missing)}")
    if args.n < 1 or args.max_tokens < 1:
        raise CliError("--n and --max-tokens must be at least 1")
    res = run(settings, args.bundles, domains, args.n, args.max_tokens, Path(args.out))
    print(json.dumps({k: {"version": v["version"], "full_block_tau": v["full_block_tau"], "draft_ms": v["draft_ms"],
                          "speedup_vs_ar": {d: {c: p["speedup_vs_ar"] for c, p in m["predicted"].items()}
                                            for d, m in v["domains"].items()}}
                      for k, v in res["candidates"].items()}, indent=1))
    return 0
