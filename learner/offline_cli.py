"""``adaflash train-offline``: prepare target-labelled data (optional) and train a drafter.

    python -m learner.data                      # target-labelled shards (resumable, cached)
    adaflash train-offline --out runs/starter --install dataplane/starter

The defaults are the committed starter's recipe (see dataplane/starter/README.md).

Rerunning the same command resumes both the data preparation (finished shards are kept
under <cache>/data/<target>) and the training (``<out>/ckpt.pt``; ``--resume`` insists on
one). ``--budget-hours`` bounds a session's share of a long run; ``--init-bundle`` starts
from an existing drafter (e.g. the committed starter) instead of a fresh initialisation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> dict[str, float]:
    return {k: float(v) for k, v in (x.split("=") for x in s.split(",") if x)}


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


# (flag, parser, help); the setting is the flag's name (``_SETTING`` renames the others)
_FLAGS = (
    ("--steps", int, None), ("--time-budget", float, "stop training after this many seconds"),
    ("--seed", int, None), ("--num-layers", int, None), ("--target-layers", _ints, "e.g. 1,18,27,29"),
    ("--init-layers", _ints, "target layers copied into the drafter (default: last ones)"),
    ("--init-bundle", str, "continue from this drafter bundle (e.g. dataplane/starter) instead of a fresh start"),
    ("--draft-vocab", int, "reduced output vocabulary; 0 = full"), ("--lr", float, None), ("--warmup", int, None),
    ("--min-lr-ratio", float, None), ("--seqs-per-step", int, None),
    ("--anchors", int, "anchors (blocks) per sequence"), ("--decay", float, None), ("--kinds", _strs, None),
    ("--domains", _strs, None),
    ("--streams", _strs, "shard streams to train on, e.g. regen-math,tf-chat"),
    ("--domain-weights", _floats, "sampling weights, e.g. math=0.4,code=0.35,chat=0.25"),
    ("--val-every", int, "steps between validations and checkpoints"),
    ("--rescan-every", int, "steps between looks for new data shards"), ("--eval-every", int, None),
    ("--eval-prompts", int, None), ("--eval-max-tokens", int, None), ("--threads", int, None),
    ("--matmul-precision", str, "float32 | bfloat16 | auto (bfloat16 where nodes serve it)"),
)
_SETTING = {"time_budget": "time_budget_s", "draft_vocab": "draft_vocab_size", "anchors": "anchors_per_seq"}


def training_config(args, settings):
    """``settings.offline`` with the flags given on the command line applied."""
    update = {}
    for flag, _, _ in _FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value is not None:
            update[_SETTING.get(name, name)] = value
    if "val_every" in update:
        update["ckpt_every"] = update["val_every"]
    if args.budget_hours is not None:
        update["time_budget_s"] = args.budget_hours * 3600.0
    if args.no_init_from_target:
        update["init_from_target"] = False
    if args.recent_input:
        update["recent_input"] = True
    if args.no_init_bigram:
        update["init_bigram"] = False
    from pydantic import ValidationError

    from adaflash.cli import CliError

    try:
        return settings.offline.model_validate(settings.offline.model_dump() | update)
    except ValidationError as e:
        raise CliError("; ".join(f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}"
                                 for err in e.errors())) from None


def register(subparsers) -> None:
    p = subparsers.add_parser("train-offline", help="train a DFlash drafter offline on target-labelled data",
                              description=__doc__)
    p.add_argument("--out", default="runs/offline", help="run directory (checkpoints, logs, plots, bundle)")
    p.add_argument("--data-root", default="", help="shards directory (default <cache>/data/<target id>)")
    p.add_argument("--prepare-seconds", type=float, default=0,
                   help="first spend this many seconds extending the data (resumable); 0: use what exists")
    # Training settings: each flag overrides the ``offline`` section (config file, ADAFLASH_OFFLINE__*),
    # whose defaults are the committed starter's recipe.
    for flag, kind, help_ in _FLAGS:
        p.add_argument(flag, type=kind, default=None, help=help_)
    p.add_argument("--budget-hours", type=float, default=None,
                   help="stop training after this many hours (resumable: the same command continues)")
    p.add_argument("--resume", action="store_true", help="require a checkpoint in --out to continue from")
    p.add_argument("--no-init-from-target", action="store_true")
    p.add_argument("--no-init-bigram", action="store_true", help="skip the bigram initialisation")
    p.add_argument("--recent-input", action="store_true",
                   help="feed each block the newest context feature too (may be added to a bundle without it)")
    p.add_argument("--install", default="", help="copy the final bundle here (e.g. dataplane/starter)")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    import torch

    from adaflash.cli import CliError
    from dataplane.runner import load_training_target
    from dataplane.target_cache import target_identity
    from dataplane.tokenizer import Tokenizer
    from learner import data as D
    from learner.offline import train

    cfg = training_config(args, settings)
    if args.resume and not (Path(args.out) / "ckpt.pt").is_file():
        raise CliError(f"--resume: no checkpoint in {args.out} (ckpt.pt); leave --resume out to start a run")
    torch.set_num_threads(cfg.threads)
    d, target = load_training_target(settings, cpu_settings=False)
    tok = Tokenizer(d)
    root = Path(args.data_root) if args.data_root else D.data_root(settings.cache, settings.model.target_id)
    if args.prepare_seconds:
        D.prepare(target, tok, root, time_budget_s=args.prepare_seconds)
    res = train(target, tok, d, root, Path(args.out), cfg, target_identity=target_identity(d))
    if args.install:
        dst = Path(args.install)
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(Path(args.out) / "bundle", dst)
    print(json.dumps({"steps": res["steps"], "val": res["val"],
                      "heldout_tau": (res["heldout_tau"] or {}).get("mean_tau")}, indent=1))
    return 0
