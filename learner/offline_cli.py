"""``adaflash train-offline``: prepare target-labelled data (optional) and train a drafter.

    python -m learner.data                      # target-labelled shards (resumable, cached)
    adaflash train-offline --out runs/starter --install dataplane/starter

The defaults are the committed starter's recipe (see dataplane/starter/README.md).

Rerunning the same command resumes both the data preparation (finished shards are kept
under <cache>/data/<target>) and the training (``<out>/ckpt.pt``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def register(subparsers) -> None:
    p = subparsers.add_parser("train-offline", help="train a DFlash drafter offline on target-labelled data",
                              description=__doc__)
    p.add_argument("--out", default="runs/offline", help="run directory (checkpoints, logs, plots, bundle)")
    p.add_argument("--data-root", default="", help="shards directory (default <cache>/data/<target id>)")
    p.add_argument("--prepare-seconds", type=float, default=0,
                   help="first spend this many seconds extending the data (resumable); 0: use what exists")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--time-budget", type=float, default=0, help="stop training after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--target-layers", default="1,18,27,29")
    p.add_argument("--init-layers", default="", help="target layers copied into the drafter (default: last ones)")
    p.add_argument("--no-init-from-target", action="store_true")
    p.add_argument("--no-init-bigram", action="store_true", help="skip the bigram initialisation")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced output vocabulary; 0 = full")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--seqs-per-step", type=int, default=2)
    p.add_argument("--anchors", type=int, default=16, help="anchors (blocks) per sequence")
    p.add_argument("--decay", type=float, default=7.0)
    p.add_argument("--kinds", default="regen,tf")
    p.add_argument("--domains", default="chat,code,math")
    p.add_argument("--streams", default="regen-math,regen-code,regen-chat,tf-code,tf-chat", help="shard streams to train on, e.g. regen-math,tf-chat (default all)")
    p.add_argument("--domain-weights", default="math=0.45,code=0.35,chat=0.2", help="sampling weights, e.g. math=0.4,code=0.35,chat=0.25")
    p.add_argument("--val-every", type=int, default=150)
    p.add_argument("--rescan-every", type=int, default=100, help="steps between looks for new data shards")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=10)
    p.add_argument("--eval-max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--install", default="", help="copy the final bundle here (e.g. dataplane/starter)")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    import torch

    from dataplane.runner import ModelRunner
    from dataplane.target_cache import ensure_target, target_identity
    from dataplane.tokenizer import Tokenizer
    from learner import data as D
    from learner.offline import TrainConfig, train

    torch.set_num_threads(args.threads)
    d = ensure_target(settings)
    target = ModelRunner.training().load_target(d)
    tok = Tokenizer(d)
    root = Path(args.data_root) if args.data_root else D.data_root(settings.cache, settings.model.target_id)
    if args.prepare_seconds:
        D.prepare(target, tok, root, time_budget_s=args.prepare_seconds)
    cfg = TrainConfig(
        seed=args.seed, num_layers=args.num_layers, target_layers=_ints(args.target_layers),
        init_from_target=not args.no_init_from_target, init_bigram=not args.no_init_bigram, init_layers=_ints(args.init_layers) or None,
        draft_vocab_size=args.draft_vocab, steps=args.steps, lr=args.lr, warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
        streams=[x for x in args.streams.split(",") if x],
        domain_weights={k: float(v) for k, v in (x.split("=") for x in args.domain_weights.split(",") if x)},
        decay=args.decay, kinds=args.kinds.split(","), domains=args.domains.split(","), val_every=args.val_every,
        ckpt_every=args.val_every, rescan_every=args.rescan_every, eval_every=args.eval_every, eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens, threads=args.threads, time_budget_s=args.time_budget)
    res = train(target, tok, d, root, Path(args.out), cfg, target_identity=target_identity(d))
    if args.install:
        dst = Path(args.install)
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(Path(args.out) / "bundle", dst)
    print(json.dumps({"steps": res["steps"], "val": res["val"],
                      "heldout_tau": (res["heldout_tau"] or {}).get("mean_tau")}, indent=1))
    return 0
