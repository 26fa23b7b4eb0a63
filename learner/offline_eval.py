"""Held-out tau: real speculative decoding with the engine, mode ``fixed`` (k = 16), greedy.

Prompts come only from ``promptsets.heldout_prompts`` (ShareGPT index % 10 == 0,
HumanEval 120..163, synthetic math seeds >= 1,000,000), shown to the target with the chat
template exactly as in training. tau per domain is the pooled mean accepted length:
(accepted draft tokens + rounds) / rounds over all requests of the domain; the outputs
are also checked token-identical to plain greedy decoding when ``check_ar`` is set.
"""

from __future__ import annotations

import json
import time

import torch

import promptsets as ds

DOMAINS = ("chat", "code", "math")


def _engine(target, drafter, mode: str, tok, max_running: int):
    from adaflash.config import DataplaneConfig
    from dataplane.engine import Engine

    cfg = DataplaneConfig(mode=mode, block_size=drafter.config.block_size if drafter is not None else 16,
                          max_running=max_running, max_verify_tokens=max_running * 16, breakeven=False)
    return Engine(target, cfg, drafter if mode != "ar" else None, drafter_version="eval" if mode != "ar" else None,
                  eos_token_ids=[tok.eos_token_id, *target.args.eos_token_ids])


def heldout_encoded(tok, domain: str, n: int, max_prompt_tokens: int) -> list[tuple[dict, list[int]]]:
    """The first ``n`` held-out prompts of ``domain`` whose templated ids fit ``max_prompt_tokens``,
    with those ids."""
    from learner.data import chat_prefix

    out = []
    for p in ds.heldout_prompts(domain, None if domain == "chat" else n * 4):
        ids = tok.encode(chat_prefix(tok, p["prompt"]))
        if len(ids) <= max_prompt_tokens:
            out.append((p, ids))
        if len(out) >= n:
            break
    return out


@torch.inference_mode()
def evaluate(target, tok, drafter, n: int = 8, max_tokens: int = 128, domains=DOMAINS, max_running: int = 8,
             max_prompt_tokens: int = 512, check_ar: bool = False) -> dict:
    """Returns {'domains': {d: {tau, rounds, tokens, per_prompt, acc1}}, 'mean_tau', 'seconds'}."""
    from dataplane.sequence import SamplingParams, Sequence

    t0 = time.time()
    out: dict = {"domains": {}, "k": drafter.config.block_size, "mode": "fixed", "temperature": 0.0,
                 "n_per_domain": n, "max_tokens": max_tokens}
    for dom in domains:
        prompts = [(p["id"], ids) for p, ids in heldout_encoded(tok, dom, n, max_prompt_tokens)]
        eng = _engine(target, drafter, "fixed", tok, max_running)
        seqs = [Sequence(pid, ids, params=SamplingParams(max_tokens=max_tokens)) for pid, ids in prompts]
        for s in seqs:
            eng.add(s)
        eng.run_until_idle()
        st = [s.stats() for s in seqs]
        rounds = sum(x["rounds"] for x in st)
        acc = sum(x["accepted_tokens"] for x in st)
        first = sum(1 for s in seqs for r in s.rounds if r.k_hat > 1 and r.accepted >= 1)
        drafted = sum(1 for s in seqs for r in s.rounds if r.k_hat > 1)
        row = {"tau": (acc + rounds) / max(rounds, 1), "rounds": rounds, "accepted": acc,
               "output_tokens": sum(len(s.output_ids) for s in seqs), "n": len(seqs),
               "acc1": first / max(drafted, 1),
               "per_prompt": {s.request_id: round(x["mean_accept_len"], 3) for s, x in zip(seqs, st, strict=True)}}
        if check_ar:
            ar = _engine(target, None, "ar", tok, max_running)
            ref = [Sequence(pid, ids, params=SamplingParams(max_tokens=max_tokens)) for pid, ids in prompts]
            for s in ref:
                ar.add(s)
            ar.run_until_idle()
            row["identical_to_ar"] = all(a.output_ids == b.output_ids for a, b in zip(seqs, ref, strict=True))
        out["domains"][dom] = row
    out["mean_tau"] = sum(r["tau"] for r in out["domains"].values()) / max(len(out["domains"]), 1)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="held-out tau of a drafter bundle (engine, fixed k, greedy)")
    ap.add_argument("bundle")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-ar", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from adaflash.config import load_config
    from dataplane.drafter_io import load_bundle
    from dataplane.runner import load_training_target
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer

    d, target = load_training_target(load_config(), cpu_settings=False)
    tok = Tokenizer(d)
    drafter, _ = load_bundle(a.bundle, target, target_identity(d))
    res = evaluate(target, tok, drafter, n=a.n, max_tokens=a.max_tokens, check_ar=a.check_ar)
    text = json.dumps(res, indent=1)
    if a.out:
        ds.write_jsonl([res], a.out) if a.out.endswith(".jsonl") else open(a.out, "w").write(text)
    print(json.dumps({"mean_tau": res["mean_tau"], **{d: r["tau"] for d, r in res["domains"].items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
