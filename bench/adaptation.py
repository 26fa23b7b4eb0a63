"""``adaflash bench adaptation``: online specialisation of the starter drafter to one narrow domain.

One tenant streams a narrow domain: prompts of the training split that the offline
stage never used (see ``NARROW_DOMAINS``), answered greedily by the target. Starting from
the committed starter drafter, each method consumes the same stream, one buffer of
``records_per_round`` FeedbackRecords per update, through the learner's own code
(``learner.supervision.Supervisor`` re-tokenizes each record and runs the frozen target;
``learner.trainer.Trainer`` runs the update with the online length head):

- ``frozen``: no update (the starter as served);
- ``osd``: forward KL (online speculative decoding, the baseline);
- ``rkl``: reverse KL alone;
- ``opd``: full OPD, reverse KL with the entry-wise clip delta and the hard-label
  mixture alpha (PAPER.md, component 1).

After every update the drafter is scored on held-out prompts of the same domain (the
held-out split of ``promptsets``, never streamed):

- ``tau``: greedy mean accepted length at k = block size, by speculative decoding
  along the target's greedy answer (a draft is accepted while it equals the target's
  argmax; the anchor then moves by accepted + 1), which is what the engine's ``fixed``
  mode realises at temperature 0;
- ``tps_model``: tokens per second of ``adaptive`` at concurrency 1 on the same
  answers: the rounds the node's speculation policy (``dataplane.spec_policy.simulate``:
  break-even, back-off, probe, calibration) serves each answer in, priced by the node's
  step-time curve measured at the start of the run; a round of verified length m yields
  min(accepted, m - 1) + 1 tokens for the measured time of verifying m tokens plus the
  drafter's forward when it drafted;
- ``head_mae``: the length head's error against the realised accepted share;
  ``head_mean`` and ``label_mean``: the mean prediction and the mean realised share
  over the same rounds (a head far below its labels makes the node stop drafting).

At the end the real engine serves the held-out prompts at concurrency 1 in modes ``ar``
and ``adaptive`` with the frozen drafter and each method's final drafter, so the speedup
over ``ar`` is measured, not modelled. The step-time curve and the engine run at the
precision nodes serve (``dataplane.runner.load_target``: bfloat16 where the CPU multiplies
it natively), each final drafter loaded from its bundle as a node loads it; training, the
target's answers and the tau scoring use the learner's float32 target. Writes result.json
and plot.png (a curve like PAPER.md's Figure 2(a)).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import promptsets as ds
from adaflash.config import LearnerConfig, Settings
from promptsets.narrow import NARROW_DOMAINS  # noqa: F401  (the domains this bench streams)

METHODS = ("frozen", "osd", "rkl", "opd")
LOSS_OF = {"osd": "osd", "rkl": "rkl", "opd": "opd"}


@dataclass
class Answered:
    prompt: dict
    prompt_text: str  # as the node ships it: the chat template applied
    prompt_ids: list[int]
    output_ids: list[int]


# ------------------------------------------------------------------------------- data


def _cache_file(cache: Path, target_id: str, domain: str, split: str, max_tokens: int) -> Path:
    """One file per target, domain, split and answer length; rows keyed by prompt id, so a
    longer run reuses every answer a shorter one produced."""
    return cache / "bench" / "adaptation" / target_id / f"{domain}-{split}-t{max_tokens}.jsonl"


def _cached_answers(cache_file: Path) -> dict[str, list[int]]:
    """Prompt id -> output ids, from the cache file and from older per-count files
    (``<domain>-<split>-n<count>-t<max_tokens>.jsonl``) beside it."""
    stem = cache_file.stem  # <domain>-<split>-t<max_tokens>
    head, _, tail = stem.rpartition("-")
    found: dict[str, list[int]] = {}
    for f in sorted(cache_file.parent.glob(f"{head}-n*-{tail}.jsonl")) + [cache_file]:
        if f.is_file():
            found.update({r["id"]: r["output_ids"] for r in ds.read_jsonl(str(f))})
    return found


def answer(target, tok, prompts: list[dict], max_tokens: int, cache_file: Path, desc: str,
           concurrency: int = 32) -> list[Answered]:
    """The target's greedy answers (our engine, mode ar, batched), cached on disk per prompt."""
    from adaflash.config import DataplaneConfig
    from dataplane.engine import Engine
    from dataplane.sequence import SamplingParams, Sequence
    from learner.data import chat_prefix

    texts = [chat_prefix(tok, p["prompt"]) for p in prompts]
    ids = [tok.encode(t) for t in texts]
    have = _cached_answers(cache_file)
    todo = [j for j, p in enumerate(prompts) if p["id"] not in have]
    if todo:
        eng = Engine(target, DataplaneConfig(mode="ar", max_running=concurrency), None,
                     eos_token_ids=[tok.eos_token_id, *target.args.eos_token_ids])
        seqs = [Sequence(prompts[j]["id"], ids[j], params=SamplingParams(max_tokens=max_tokens)) for j in todo]
        pending = list(seqs)  # fed as requests finish: the engine's admission bounds what may queue
        with tqdm(total=len(seqs), desc=desc, unit="answer") as bar:
            done = 0
            while pending or eng.load["waiting"] or eng.load["running"]:
                while pending and eng.load["waiting"] + eng.load["running"] < 2 * concurrency:
                    eng.add(pending.pop(0))
                eng.step()
                now = sum(1 for s in seqs if s.finished_at is not None)
                bar.update(now - done)
                done = now
        have.update({prompts[j]["id"]: s.output_ids for j, s in zip(todo, seqs, strict=True)})
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        ds.write_jsonl([{"id": k, "output_ids": v} for k, v in have.items()], str(tmp))
        tmp.replace(cache_file)
    return [Answered(p, t, i, have[p["id"]]) for p, t, i in zip(prompts, texts, ids, strict=True)]


def to_record(a: Answered, tok, identity: dict, tenant: str, domain: str):
    """The FeedbackRecord a node would emit for this answer: the templated prompt and the
    detokenized answer (special tokens, EOS included, are not part of the text)."""
    from adaflash.contracts.feedback import FeedbackRecord

    return FeedbackRecord(
        tenant_id=tenant, node_id="bench", request_id=a.prompt["id"], target_model={"id": identity["id"],
                                                                                   "sha256": identity["sha256"]},
        drafter_version="starter", mode="adaptive", sampling={"temperature": 0.0, "top_p": 1.0}, domain=domain,
        prompt_text=a.prompt_text, response_text=tok.decode(a.output_ids),
        stats={"tau_mean": 1.0, "verify_tokens": len(a.output_ids), "draft_ms": 0.0, "verify_ms": 0.0})


def supervise_trajectories(sup, answered: list[Answered], tok, identity: dict, domain: str) -> list:
    """Target states along the exact greedy token trajectories (held-out scoring), with no
    detour through text: prompt ids + answer ids up to, not including, a final EOS."""
    from learner.supervision import Tokenized

    items = []
    for a in answered:
        out = a.output_ids[:-1] if a.output_ids and a.output_ids[-1] == tok.eos_token_id else a.output_ids
        items.append(Tokenized(to_record(a, tok, identity, "eval", domain), a.prompt_ids + out, len(a.prompt_ids)))
    return sup.supervise(items)


# ------------------------------------------------------------------------------- scoring


@dataclass
class StepCost:
    """Measured step times of the node at concurrency 1: verify of m tokens, drafter block."""

    verify_s: list[float]  # index m-1
    draft_s: float

    def as_cost_model(self):
        """The measured curve at concurrency 1: verify of m tokens -> its measured time."""
        from dataplane.cost_model import CostModel

        c = CostModel(draft_per_request_s=self.draft_s)
        for m, t in enumerate(self.verify_s, 1):
            c.set_point(1, m, t)
        return c


@torch.inference_mode()
def measure_cost(target, drafter, prompt_ids: list[int], k: int, repeats: int = 5) -> StepCost:
    from bench.step_cost import drafter_pass_s

    ctx = torch.tensor(prompt_ids, dtype=torch.int64)
    kv = target.new_cache(len(prompt_ids) + k + 1)
    target.forward_packed(ctx, [0, len(prompt_ids)], [kv])
    base = kv.length
    times = []
    for m in range(1, k + 1):
        ts = []
        for _ in range(repeats):
            kv.truncate(base)
            t0 = time.perf_counter()
            target.forward_packed(ctx[-m:], [0, m], [kv])
            ts.append(time.perf_counter() - t0)
        times.append(statistics.median(ts))
    return StepCost(times, drafter_pass_s(target, drafter, prompt_ids, repeats + 1))


@torch.no_grad()
def score(drafter, sups, cost: StepCost, policy=None) -> dict:
    """Held-out tau, modelled adaptive TPS at concurrency 1 and head MAE (see module doc).

    ``policy``: the node's configured ``PolicyConfig`` (None: the defaults), walked at the drafter's block size."""
    from dataplane import spec_policy as sp
    from learner.trainer import greedy_accepted

    cm = cost.as_cost_model()
    k = drafter.config.block_size
    policy = dataclasses.replace(policy or sp.PolicyConfig(), block_size=k)
    was_training = drafter.training
    drafter.eval()
    rounds = accepted = first = 0
    tokens = 0
    seconds = 0.0
    errs, preds, labels = [], [], []
    for sup in sups:
        lo, hi = sup.prompt_len, sup.length - 2
        if hi < lo:
            continue
        anchors = torch.arange(lo, hi + 1)
        h = drafter.forward_train(sup.ctx_hidden, sup.tokens, anchors)  # [A, k, H]
        drafts = drafter.to_target_ids(drafter.logits(h[:, 1:]).argmax(-1))
        acc = greedy_accepted(drafts, sup, anchors).tolist()
        a_hat = drafter.length_head(h).tolist()
        # A round at anchor pos commits at most the L - 1 - pos tokens left (the engine caps
        # the verified length by max_tokens the same way).
        acc = [min(a, sup.length - 2 - (lo + i)) for i, a in enumerate(acc)]
        pos = lo
        while pos <= hi:  # fixed k: the anchor moves by accepted + 1
            a = acc[pos - lo]
            rounds += 1
            accepted += a
            first += int(a >= 1)
            errs.append(abs(a_hat[pos - lo] - sp.head_label(a, k)))
            preds.append(a_hat[pos - lo])
            labels.append(sp.head_label(a, k))
            pos += a + 1
        # adaptive: the rounds the node's speculation policy serves this response in
        for r in sp.simulate(a_hat, acc, hi - lo + 1, policy, cm):
            tokens += r.accepted + 1
            seconds += cost.verify_s[r.k_hat - 1] + (cost.draft_s if r.k_hat > 1 else 0.0)  # 1: backed off
    drafter.train(was_training)
    return {"tau": (accepted + rounds) / max(rounds, 1), "acc1": first / max(rounds, 1),
            "head_mae": sum(errs) / max(len(errs), 1), "head_mean": sum(preds) / max(len(preds), 1),
            "label_mean": sum(labels) / max(len(labels), 1), "tps_model": tokens / seconds if seconds else 0.0,
            "rounds": rounds}


def engine_tps(target, tok, drafter, answered: list[Answered], mode: str, max_tokens: int) -> dict:
    """Real serving at concurrency 1 (closed loop) on the held-out prompts."""
    from adaflash.config import DataplaneConfig
    from bench.throughput import run_closed_loop
    from dataplane.engine import Engine

    cfg = DataplaneConfig(mode=mode, block_size=drafter.config.block_size if drafter else 16, max_running=1)
    eng = Engine(target, cfg, drafter if mode != "ar" else None, drafter_version="bench" if mode != "ar" else None,
                 eos_token_ids=[tok.eos_token_id, *target.args.eos_token_ids])
    r = run_closed_loop(eng, [a.prompt_ids for a in answered], 1, max_tokens)
    return {k: r[k] for k in ("tps", "tau", "mean_k_hat", "tokens", "wall_s")} | {"outputs": r["outputs"]}


# ------------------------------------------------------------------------------- the run


def run(settings: Settings, domain: str, rounds: int, out: Path, records_per_round: int = 8, n_eval: int = 8,
        max_tokens: int = 96, methods: tuple[str, ...] = METHODS, tps_prompts: int = 4, tps_max_tokens: int = 64,
        drafter_dir: str | None = None, learner_overrides: dict | None = None) -> dict:
    from dataplane.drafter_io import load_bundle, save_bundle
    from dataplane.node import STARTER_DIR
    from dataplane.runner import load_target, load_training_target
    from dataplane.spec_policy import PolicyConfig
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer
    from learner.supervision import Supervisor
    from learner.trainer import Trainer

    _check_args(domain, methods, rounds, records_per_round, n_eval)
    nd = NARROW_DOMAINS[domain]
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tdir, target = load_training_target(settings)
    identity = target_identity(tdir)
    tok = Tokenizer(tdir)
    bundle = Path(drafter_dir) if drafter_dir else STARTER_DIR
    starter, _ = load_bundle(bundle, target, identity)
    lc = settings.learner.model_copy(update=learner_overrides or {})
    policy = dataclasses.replace(PolicyConfig.of(settings.dataplane), mode="adaptive")  # what tps_model models
    cache = Path(settings.cache)

    stream_p = nd.stream(rounds * records_per_round)
    if len(stream_p) < rounds * records_per_round:
        raise ValueError(f"domain {domain} has only {len(stream_p)} stream prompts for {rounds} x {records_per_round}")
    eval_p = nd.heldout(n_eval)
    stream = answer(target, tok, stream_p, max_tokens,
                    _cache_file(cache, identity["id"], domain, "stream", max_tokens), "stream answers")
    held = answer(target, tok, eval_p, max_tokens,
                  _cache_file(cache, identity["id"], domain, "heldout", max_tokens), "held-out answers")
    sup = Supervisor(target, tok, identity, list(starter.config.target_layers), max_tokens=lc.max_record_tokens,
                     prompt_format="as_sent")
    records = [to_record(a, tok, identity, f"tenant-{domain}", nd.base) for a in stream]
    with tqdm(total=2, desc="target supervision", unit="set") as bar:
        stream_sups = sup.supervise([sup.tokenize(r) for r in records])
        bar.update()
        held_sups = supervise_trajectories(sup, held, tok, identity, nd.base)
        bar.update()
    # Step costs and the engine's tokens/s at the precision nodes serve (the learner trains in float32).
    served = load_target(settings, tdir)
    served.warm_up()
    served_starter = load_bundle(bundle, served, identity)[0]
    cost = measure_cost(served, served_starter, held[0].prompt_ids + held[0].output_ids[:8], starter.config.block_size)

    frozen = score(starter, held_sups, cost, policy)
    curves: dict[str, list[dict]] = {"frozen": [{"update": 0, "records": 0, **frozen}]}
    finals = {"frozen": starter}
    train_s: dict[str, float] = {}
    for method in methods:
        if method == "frozen":
            continue
        d = copy.deepcopy(starter)
        cfg = LearnerConfig(**(lc.model_dump() | {"loss": LOSS_OF[method]}))
        trainer = Trainer(d, sup, cfg, policy)
        rows = [{"update": 0, "records": 0, **frozen}]
        t0 = time.time()
        for u in tqdm(range(1, rounds + 1), desc=f"{method} updates", unit="update"):
            buf = stream_sups[(u - 1) * records_per_round: u * records_per_round]
            parts = trainer.train_buffer(buf, step=u)
            rows.append({"update": u, "records": u * records_per_round, **score(d, held_sups, cost, policy),
                         "train": {k: round(v, 5) for k, v in parts.items()}})
        train_s[method] = round(time.time() - t0, 1)
        d.eval().requires_grad_(False)
        curves[method] = rows
        finals[method] = d
        save_bundle(d, out / "drafters" / method, identity, version=f"{domain}-{method}-u{rounds}",
                    training={"bench": "adaptation", "domain": domain, "method": method, "updates": rounds,
                              "records": rounds * records_per_round})
    for u in range(1, rounds + 1):
        curves["frozen"].append({"update": u, "records": u * records_per_round, **frozen})

    tps_set = held[:tps_prompts]
    served_drafters = {name: served_starter if name == "frozen" else load_bundle(out / "drafters" / name, served,
                                                                                  identity)[0] for name in finals}
    real = _engine_c1(served, tok, served_drafters, tps_set, tps_max_tokens)
    summary = _summary(curves, frozen, real)
    result = {
        "bench": "adaptation", "domain": domain, "domain_description": nd.description, "rounds": rounds,
        "records_per_round": records_per_round, "stream_tokens": sum(len(a.output_ids) for a in stream),
        "eval_prompts": len(held), "max_tokens": max_tokens, "block_size": starter.config.block_size,
        "drafter": str(bundle), "learner": {k: getattr(lc, k) for k in ("alpha", "delta", "lr_drafter", "lr_head",
                                                                       "epochs", "grad_accum", "anchors_per_record",
                                                                       "head_label", "head_loss")},
        "served_precision": str(served.lm_head.weight.dtype).removeprefix("torch."),
        "step_cost_c1": {"verify_s": [round(x, 5) for x in cost.verify_s], "draft_s": round(cost.draft_s, 5)},
        "engine_c1": {"prompts": len(tps_set), "max_tokens": tps_max_tokens, "ar": real["ar"]},
        "train_seconds": train_s, "summary": summary, "curves": curves,
        "seconds": round(time.time() - t_start, 1), "torch_threads": torch.get_num_threads(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "plot.png")
    return result


def _check_args(domain: str, methods: tuple[str, ...], rounds: int, records_per_round: int, n_eval: int) -> None:
    if domain not in NARROW_DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; choose from {sorted(NARROW_DOMAINS)}")
    bad = [m for m in methods if m not in METHODS]
    if bad or "frozen" not in methods:
        raise ValueError(f"methods must include 'frozen' and come from {METHODS}; got {list(methods)}")
    if rounds < 1 or records_per_round < 1 or n_eval < 1:
        raise ValueError("--rounds, --records-per-round and --eval-prompts must be positive")


def _engine_c1(target, tok, finals: dict, tps_set: list, tps_max_tokens: int) -> dict:
    """The real engine at concurrency 1: ar against adaptive with each final drafter."""
    real = {"ar": engine_tps(target, tok, None, tps_set, "ar", tps_max_tokens)}
    for name, d in tqdm(list(finals.items()), desc="engine at C=1", unit="drafter"):
        real[name] = engine_tps(target, tok, d, tps_set, "adaptive", tps_max_tokens)
    ar_out = real["ar"].pop("outputs")
    for name, r in real.items():
        if name != "ar":
            r["identical_to_ar"] = r.pop("outputs") == ar_out
            r["speedup_vs_ar"] = r["tps"] / real["ar"]["tps"]
    return real


def _summary(curves: dict[str, list[dict]], frozen: dict, real: dict) -> dict:
    summary = {}
    for name, rows in curves.items():
        best = max(rows, key=lambda r: r["tau"])
        summary[name] = {"final_tau": rows[-1]["tau"], "final_tau_gain_vs_frozen": rows[-1]["tau"] / frozen["tau"],
                         "best_tau": best["tau"], "best_update": best["update"],
                         "first_update_at_1.5x_frozen": next((r["update"] for r in rows
                                                              if r["tau"] >= 1.5 * frozen["tau"]), None),
                         "final_tps_model": rows[-1]["tps_model"], "final_head_mae": rows[-1]["head_mae"],
                         "engine_c1": real.get(name)}
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    style = {"frozen": ("grey", "--"), "osd": ("tab:blue", "-"), "rkl": ("tab:orange", "-"), "opd": ("tab:red", "-")}
    ar = result["engine_c1"]["ar"]["tps"]
    for name, rows in result["curves"].items():
        c, ls = style.get(name, ("black", "-"))
        x = [r["records"] for r in rows]
        ax1.plot(x, [r["tau"] for r in rows], color=c, linestyle=ls, label=name)
        ax2.plot(x, [r["tps_model"] for r in rows], color=c, linestyle=ls, label=f"{name} (model)")
        real = result["summary"][name]["engine_c1"]
        if real:
            ax2.scatter([x[-1]], [real["tps"]], color=c, marker="o", zorder=3)
    ax2.axhline(ar, color="black", linewidth=0.8, label=f"ar (engine) {ar:.2f}")
    ax1.set_xlabel("records streamed")
    ax1.set_ylabel(f"held-out tau (greedy, k = {result['block_size']})")
    ax1.set_title(f"adaptation on {result['domain']}")
    ax2.set_xlabel("records streamed")
    ax2.set_ylabel("tokens/s at C = 1 (dots: engine)")
    ax1.legend()
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
