"""Offline DFlash drafter training on target-labelled shards (``learner.data``).

Per step: draw sequences (domains balanced), draw anchors inside each answer, build the
masked blocks and run ``Drafter.forward_train`` with the target's stored hidden states
injected as context keys/values. Loss: cross-entropy on the target's top-1 tokens over
the draft vocabulary with per-position weight exp(-(i-1)/decay) for block positions
i = 1..k-1. The length head is fitted at the same time (MSE on features detached from
the drafter) against the simulated acceptance ratio: the number of leading block
positions whose greedy draft equals the target's top-1, over k-1.

For teacher-forced text, block position i is trained only while the real tokens inside
the block agree with the target's top-1 (beyond the first disagreement the target would
never have reached that state, so speculation never meets it).

Resumable: ``<out>/ckpt.pt`` holds drafter, optimiser, step and RNG state; rerunning
the same command continues. Writes ``log.jsonl``, ``loss.png``, ``tau.png`` and the
final bundle (``<out>/bundle``) with its manifest.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from adaflash.config import OfflineConfig
from dataplane import spec_policy as sp
from learner import data as D
from learner.anchors import sample_anchors
from learner.offline_plots import plot

# The training settings are typed in the one configuration (section ``offline``).
TrainConfig = OfflineConfig


# Settings that may change when a run is resumed (steps: the schedule is recomputed).
# The data mix may change too (a curriculum); every start is logged with its config and
# listed in the manifest's ``phases``.
RUN_CONTROL = {"steps", "time_budget_s", "threads", "matmul_precision", "eval_every", "eval_prompts", "eval_max_tokens", "val_every",
               "ckpt_every", "rescan_every", "streams", "domain_weights", "kinds", "domains"}


# --------------------------------------------------------------------------- data pool


class Pool:
    """Sequences of all shards in memory (hidden states float16), by domain; a few per shard
    are held back for validation (training-distribution acceptance, not the held-out tau)."""

    def __init__(self, root: Path, cfg: TrainConfig, stored_layers: list[int]):
        self.root, self.cfg = root, cfg
        self.layer_idx = [stored_layers.index(layer) for layer in cfg.target_layers]
        self.loaded: set[str] = set()
        self.train: dict[str, list[D.Example]] = {}
        self.val: list[D.Example] = []
        self.tokens = 0
        self.stream_tokens: dict[str, int] = {}  # training tokens per stream (validation excluded)
        self.prep_seconds = 0.0  # data-preparation wall seconds of the loaded shards
        self.refresh()

    def refresh(self) -> int:
        new = 0
        for p in D.list_shards(self.root, kinds=self.cfg.kinds, domains=self.cfg.domains):
            if self.cfg.streams and p.parent.name not in self.cfg.streams:
                continue
            if str(p) in self.loaded:
                continue
            self.loaded.add(str(p))
            exs = D.load_shard(p, self.layer_idx)
            self.prep_seconds += json.loads(p.with_suffix(".json").read_text()).get("seconds", 0.0)
            nv = self.cfg.max_shard_seqs_val
            self.val.extend(exs[:nv])
            for e in exs[nv:]:
                if len(e.tokens) - e.resp_start < 4:
                    continue
                self.train.setdefault(e.domain, []).append(e)
                self.tokens += len(e.tokens)
                self.stream_tokens[p.parent.name] = self.stream_tokens.get(p.parent.name, 0) + len(e.tokens)
                new += 1
        return new

    def sample(self, rng: random.Random, n: int) -> list[D.Example]:
        doms = sorted(self.train)
        wts = [self.cfg.domain_weights.get(d, 1.0) if self.cfg.domain_weights else 1.0 for d in doms]
        return [rng.choice(self.train[rng.choices(doms, wts)[0]]) for _ in range(n)]

    def label_counts(self) -> Counter:
        c: Counter = Counter()
        for exs in self.train.values():
            for e in exs:
                c.update(e.labels[e.resp_start - 1:].tolist())
        return c


# --------------------------------------------------------------------------- model


def build_drafter(target, cfg: TrainConfig):
    from torch import nn

    from dataplane.drafter import Drafter, DrafterConfig

    dc = DrafterConfig.for_target(target.args, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                  draft_vocab_size=cfg.draft_vocab_size, head_hidden=cfg.head_hidden,
                                  recent_input=cfg.recent_input)
    dc.target_layers = list(cfg.target_layers)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        d = Drafter(dc)
        for m in d.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if d.recent_proj is not None:
            nn.init.zeros_(d.recent_proj.weight)
    d.rotary.inv_freq = d.rotary.inv_freq.float()
    d.bind(target)
    if cfg.init_from_target:
        d.init_from_target(target, cfg.init_layers)
    return d


# --------------------------------------------------------------------------- one step


def position_weights(k: int, decay: float) -> torch.Tensor:
    """[k] weights for block positions 0..k-1 (position 0 holds the known token: weight 0)."""
    w = torch.exp(-(torch.arange(k, dtype=torch.float32) - 1) / decay)
    w[0] = 0
    return w


def make_targets(ex: D.Example, anchors: torch.Tensor, k: int, vocab_index: torch.Tensor | None,
                 consistent: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels [A, k] in the draft vocabulary, a validity mask [A, k] for block positions and
    an in-vocabulary mask [A, k] (a label outside the draft vocabulary cannot be drafted:
    no loss, and it counts as a miss).

    Position i of the block at anchor a is labelled with the target's top-1 after token
    a+i-1 (``ex.labels[a+i-1]``).
    """
    L = len(ex.tokens)
    idx = anchors.unsqueeze(1) + torch.arange(k) - 1  # [A, k] label index a+i-1
    valid = (idx >= anchors.unsqueeze(1)) & (idx <= L - 1)
    idx_c = idx.clamp(0, L - 1)
    lab = ex.labels[idx_c]
    if consistent and ex.kind in ("tf", "sample"):
        # real token at a+j equals target top-1 after a+j-1 for all 1 <= j < i
        tok_next = ex.tokens[(idx_c + 1).clamp(max=L - 1)]
        agree = (tok_next == lab) | ~valid
        ok = torch.ones_like(valid)
        ok[:, 2:] = torch.cumprod(agree[:, 1:-1].int(), dim=1).bool()
        valid = valid & ok
    invocab = torch.ones_like(valid)
    if vocab_index is not None:
        mapped = vocab_index[lab]
        invocab = mapped >= 0
        lab = mapped.clamp(min=0)
    valid[:, 0] = False
    return lab, valid, invocab


def block_losses(drafter, exs: list[D.Example], cfg: TrainConfig, rng: random.Random, w: torch.Tensor,
                 vocab_index: torch.Tensor | None):
    """Returns (CE loss, head MSE, stats) for a list of sequences."""
    k = cfg.block_size
    ce_sum = torch.zeros(())
    wsum = 0.0
    hs, accs, correct, counted, first_ok, first_n = [], [], 0, 0, 0, 0
    for ex in exs:
        L = len(ex.tokens)  # an answer too short for a block still trains the last one
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        anchors = sample_anchors(min(ex.resp_start, L - 2), L, cfg.anchors_per_seq, gen)
        if not anchors.numel():  # fewer than three tokens: no block to draft
            continue
        end = int(anchors.max()) + 1  # context needed: positions < anchor; tokens up to max anchor
        h = drafter.forward_train(ex.hidden[:end].float(), ex.tokens[:end], anchors)  # [A, k, H]
        lab, valid, invocab = make_targets(ex, anchors, k, vocab_index, cfg.tf_consistent_mask)
        logits = drafter.logits(h[:, 1:])  # [A, k-1, Vd]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), reduction="none")
        ww = (w[1:].unsqueeze(0) * (valid & invocab)[:, 1:].float()).reshape(-1)
        ce_sum = ce_sum + (ce * ww).sum()
        wsum += float(ww.sum())
        with torch.no_grad():
            hit = (logits.argmax(-1) == lab[:, 1:]) & (valid & invocab)[:, 1:]
            run = torch.cumprod(hit.int(), dim=1).sum(1)  # leading accepted drafts per block
            accs.append(sp.head_label(run.float(), k))  # the head's label, as the online learner's
            correct += int(hit.sum())
            counted += int(valid[:, 1:].sum())
            first_ok += int(hit[:, 0].sum())
            first_n += int(valid[:, 1].sum())
        hs.append(h.detach())
    loss = ce_sum / max(wsum, 1e-6)
    if not accs:
        zero = torch.zeros((), requires_grad=True)
        return zero, zero, {"acc": 0.0, "acc1": 0.0, "sim_tau": 1.0}
    a_star = torch.cat(accs)
    a_hat = drafter.length_head(torch.cat(hs))
    head_loss = F.mse_loss(a_hat, a_star)
    stats = {"acc": correct / max(counted, 1), "acc1": first_ok / max(first_n, 1),
             "sim_tau": 1 + float(a_star.mean()) * (k - 1)}
    return loss, head_loss, stats


@torch.no_grad()
def validate(drafter, pool: Pool, cfg: TrainConfig, vocab_index) -> dict:
    rng = random.Random(1234)
    w = position_weights(cfg.block_size, cfg.decay)
    by: dict[str, list] = {}
    for ex in pool.val:
        loss, hl, st = block_losses(drafter, [ex], cfg, rng, w, vocab_index)
        by.setdefault(ex.domain, []).append((float(loss), float(hl), st["acc1"], st["sim_tau"]))
    out = {}
    for dom, rows in sorted(by.items()):
        n = len(rows)
        out[dom] = {"loss": sum(r[0] for r in rows) / n, "head_mse": sum(r[1] for r in rows) / n,
                    "acc1": sum(r[2] for r in rows) / n, "sim_tau": sum(r[3] for r in rows) / n, "n": n}
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


# --------------------------------------------------------------------------- the loop


def _restore_or_init(target, tok, pool: Pool, ckpt: Path, cfg: TrainConfig):
    """(drafter, checkpoint state or None, initialisation stats): resumed from ``ckpt`` when it
    exists (refused if written with another configuration), else freshly initialised."""
    drafter = build_drafter(target, cfg)
    init_stats = None
    state = None
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        changed = {k for k in set(state["config"]) | set(cfg.model_dump())
                   if state["config"].get(k) != cfg.model_dump().get(k) and k not in RUN_CONTROL}
        if changed:
            raise RuntimeError(f"{ckpt} was written with a different configuration ({sorted(changed)}); "
                               "use another --out")
        drafter.set_vocab_map(state["vocab_map"])
        drafter.load_state_dict(state["drafter"])
    elif cfg.init_bundle:
        _continue_from(drafter, target, cfg)
    else:
        if cfg.draft_vocab_size:
            from learner.offline_init import frequent_vocab, text_token_counts

            drafter.set_vocab_map(frequent_vocab(pool, cfg.draft_vocab_size, [tok.eos_token_id],
                                                 target.args.vocab_size,
                                                 text_token_counts(tok) if cfg.vocab_prior else None))
        drafter.bind(target)
        if cfg.init_bigram:
            from learner.offline_init import bigram_counts, fit_bigram

            init_stats = fit_bigram(drafter, target, bigram_counts([e for v in pool.train.values() for e in v]),
                                    temperature=cfg.bigram_temperature)
    drafter.bind(target)
    return drafter, state, init_stats


def _continue_from(drafter, target, cfg: TrainConfig) -> None:
    """Weights and draft vocabulary of ``cfg.init_bundle`` (a run continued across sessions or from
    the committed starter); refused when the bundle's shape is not this configuration's, except
    that a run may add the recent-feature input (it starts at zero)."""
    from dataplane.drafter_io import load_bundle

    src, _ = load_bundle(cfg.init_bundle, target)
    want = {"num_layers": cfg.num_layers, "target_layers": list(cfg.target_layers), "block_size": cfg.block_size,
            "draft_vocab_size": cfg.draft_vocab_size, "head_hidden": cfg.head_hidden}
    have = {k: getattr(src.config, k) for k in want}
    if have != want:
        diff = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
        raise RuntimeError(f"{cfg.init_bundle} does not have this run's shape (bundle, run): {diff}")
    if src.config.recent_input and not cfg.recent_input:
        raise RuntimeError(f"{cfg.init_bundle} has the recent-feature input; set recent_input to continue it")
    drafter.set_vocab_map(src.vocab_map.clone())
    missing, _ = drafter.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v
                                          for k, v in src.state_dict().items()}, strict=False)
    if set(missing) - {"recent_proj.weight"}:
        raise RuntimeError(f"{cfg.init_bundle} lacks weights: {sorted(missing)}")


def _bundle_version(cfg: TrainConfig) -> tuple[str, dict]:
    """``starter-0`` for a fresh run; a run continued from ``starter-N`` makes ``starter-N+1``, with
    the bundle it continued from as its parent."""
    if not cfg.init_bundle:
        return "starter-0", {"source": "offline"}
    from dataplane.drafter_io import read_manifest

    parent = read_manifest(Path(cfg.init_bundle)).version
    head, _, n = parent.rpartition("-")
    version = f"{head}-{int(n) + 1}" if head and n.isdigit() else f"{parent}-1"
    return version, {"source": "offline", "parent_version": parent}


def _vocab_index(drafter, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: each target token's index in the draft vocabulary, -1 where absent."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64)
    index[drafter.vocab_map] = torch.arange(drafter.vocab_map.numel())
    return index


def _resume(state: dict | None, opt, rng: random.Random) -> tuple[int, float, int, float]:
    """Optimiser and RNG state from a checkpoint; (step, compute_s, seen_tokens, cpu_s) so far."""
    if state is None:
        return 0, 0.0, 0, 0.0
    opt.load_state_dict(state["opt"])
    rng.setstate(state["rng"])
    return state["step"], state["compute_s"], state["seen_tokens"], state.get("cpu_s", 0.0)


def _optimizer(drafter, cfg: TrainConfig):
    """AdamW over the drafter body and (own learning rate, no decay) the length head; also
    returns the body's parameters, whose gradient norm is clipped."""
    head_params = list(drafter.length_head.parameters())
    hp = {id(p) for p in head_params}
    body = [p for p in drafter.parameters() if id(p) not in hp and p.requires_grad]
    opt = torch.optim.AdamW([{"params": body, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
                             {"params": head_params, "lr": cfg.head_lr, "weight_decay": 0.0}])
    return opt, body


def matmul_dtype(cfg: TrainConfig) -> torch.dtype:
    """The training products' precision: ``cfg.matmul_precision``, auto resolved to what nodes
    on this machine serve (the measured choice, ``dataplane.precision``)."""
    want = cfg.matmul_precision
    if want == "auto":
        from adaflash.config import Settings
        from dataplane.runner import serving_precision

        want = serving_precision(Settings(), "cpu").dtype
    return torch.bfloat16 if want == "bfloat16" else torch.float32


def _train_step(drafter, opt, body, pool: Pool, cfg: TrainConfig, rng: random.Random, w, vocab_index, step: int,
                dtype: torch.dtype = torch.float32):
    """One optimiser step (products in ``dtype``); returns (loss, head loss, stats, examples)."""
    for g, base in zip(opt.param_groups, (cfg.lr, cfg.head_lr), strict=True):
        g["lr"] = base * lr_at(step, cfg)
    exs = pool.sample(rng, cfg.seqs_per_step)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss, head_loss, st = block_losses(drafter, exs, cfg, rng, w, vocab_index)
    opt.zero_grad(set_to_none=True)
    (loss + head_loss).backward()
    torch.nn.utils.clip_grad_norm_(body, 1.0)
    opt.step()
    return loss, head_loss, st, exs


def _training_record(cfg: TrainConfig, out: Path, data_root: Path, pool: Pool, step: int, stopped: str,
                     seen_tokens: int, compute_s: float, cpu_s: float, val: dict, res: dict | None,
                     dtype: torch.dtype = torch.float32) -> dict:
    """What the bundle's manifest and result.json say about this run."""
    return {
        "seed": cfg.seed, "config": cfg.model_dump(), "steps": step, "stopped": stopped,
        "phases": [{"step": r["step"], "config": r["config"]} for r in
                   (json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip())
                   if r["type"] == "start"],
        "data": {"description": "target-labelled tokens from the training split of promptsets "
                                "(ShareGPT V3 non-held-out conversations, HumanEval tasks 0-119, synthetic "
                                "math seeds < 1,000,000): teacher-forced prefill over reference text (tf) and "
                                "target greedy answers regenerated with the engine (regen)",
                 "root": str(data_root), "trained_tokens_by_stream": pool.stream_tokens,
                 "trained_tokens": pool.tokens, "validation_sequences": len(pool.val),
                 "available_at_end": D.summary(data_root)},
        "block_tokens_seen": seen_tokens, "blocks_seen": step * cfg.seqs_per_step * cfg.anchors_per_seq,
        "compute": {"train_wall_seconds": round(compute_s, 1), "train_cpu_seconds": round(cpu_s, 1),
                    "threads": cfg.threads, "device": "cpu", "matmul_precision": str(dtype).removeprefix("torch."),
                    "data_prep_wall_seconds_of_trained_shards": round(pool.prep_seconds, 1)},
        "val": val, "heldout_tau": res,
    }


def train(target, tok, target_dir: Path, data_root: Path, out: Path, cfg: TrainConfig, progress: bool = True,
          target_identity: dict | None = None) -> dict:
    from tqdm import tqdm

    dtype = matmul_dtype(cfg)  # before the threads: the precision probe applies the node's settings
    torch.set_num_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    pool = Pool(data_root, cfg, list(D.store_layers(target.args.num_layers)))
    if not pool.train:
        raise RuntimeError(f"no training shards under {data_root}; run `python -m learner.data` first")
    ckpt = out / "ckpt.pt"
    drafter, state, init_stats = _restore_or_init(target, tok, pool, ckpt, cfg)
    vocab_index = _vocab_index(drafter, target.args.vocab_size) if cfg.draft_vocab_size else None
    opt, body = _optimizer(drafter, cfg)
    rng = random.Random(cfg.seed)
    step, compute_s, seen_tokens, cpu_s = _resume(state, opt, rng)
    log_f = open(out / "log.jsonl", "a")

    def log(row):
        log_f.write(json.dumps(row) + "\n")
        log_f.flush()

    def save_ckpt():
        tmp = out / "ckpt.pt.tmp"
        torch.save({"config": cfg.model_dump(), "drafter": drafter.state_dict(), "vocab_map": drafter.vocab_map,
                    "opt": opt.state_dict(), "step": step, "compute_s": compute_s, "seen_tokens": seen_tokens, "cpu_s": cpu_s,
                    "rng": rng.getstate(), "pool_tokens": pool.tokens}, tmp)
        os.replace(tmp, ckpt)

    def run_eval():
        from learner.offline_eval import evaluate

        drafter.eval()
        res = evaluate(target, tok, drafter, n=cfg.eval_prompts, max_tokens=cfg.eval_max_tokens)
        drafter.train()
        log({"type": "eval", "step": step, "tau": {d: r["tau"] for d, r in res["domains"].items()},
             "mean_tau": res["mean_tau"], "detail": res})
        return res

    log({"type": "start", "step": step, "config": cfg.model_dump(), "pool_tokens": pool.tokens, "init": init_stats,
         "streams": sorted({Path(p).parent.name for p in pool.loaded})})
    if step == 0 and cfg.val_every:
        drafter.eval()
        log({"type": "val", "step": 0, "val": validate(drafter, pool, cfg, vocab_index)})
    w = position_weights(cfg.block_size, cfg.decay)
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc="train", unit="step")
    drafter.train()
    ema = None
    last_tau: dict[str, str] = {}  # the latest held-out tau per domain, shown on the progress bar
    stopped = "steps"
    while step < cfg.steps:
        if cfg.time_budget_s and time.time() - t_start > cfg.time_budget_s:
            stopped = "time budget"
            break
        if cfg.rescan_every and step and step % cfg.rescan_every == 0:
            if pool.refresh():
                log({"type": "data", "step": step, "pool_tokens": pool.tokens,
                     "seqs": {d: len(v) for d, v in pool.train.items()}})
        t0, c0 = time.time(), time.process_time()
        loss, head_loss, st, exs = _train_step(drafter, opt, body, pool, cfg, rng, w, vocab_index, step, dtype)
        step += 1
        compute_s += time.time() - t0
        cpu_s += time.process_time() - c0
        seen_tokens += sum(min(len(e.tokens), cfg.anchors_per_seq * cfg.block_size) for e in exs)
        lv = float(loss.detach())
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        if step % 10 == 0:
            log({"type": "train", "step": step, "loss": lv, "head_mse": float(head_loss.detach()),
                 "lr": opt.param_groups[0]["lr"], **st, "compute_s": round(compute_s, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{st['acc1']:.2f}", **last_tau)
        if cfg.val_every and step % cfg.val_every == 0:
            drafter.eval()
            log({"type": "val", "step": step, "val": validate(drafter, pool, cfg, vocab_index)})
            drafter.train()
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            save_ckpt()
            plot(out)
        if cfg.eval_every and step % cfg.eval_every == 0:
            last_tau = {f"tau_{d}": f"{r['tau']:.2f}" for d, r in run_eval()["domains"].items()}
    bar.close()
    save_ckpt()
    drafter.eval()
    val = validate(drafter, pool, cfg, vocab_index)
    log({"type": "val", "step": step, "val": val})
    res = run_eval() if cfg.eval_prompts else None
    plot(out)
    training = _training_record(cfg, out, data_root, pool, step, stopped, seen_tokens, compute_s, cpu_s, val, res, dtype)
    bundle = out / "bundle"
    from dataplane.drafter_io import save_bundle
    from dataplane.target_cache import target_identity as tid

    ident = target_identity or tid(target_dir)
    version, lineage = _bundle_version(cfg)
    save_bundle(drafter, bundle, ident, version=version, lineage=lineage, training=training)
    (out / "result.json").write_text(json.dumps(training, indent=1))
    log_f.close()
    return training
