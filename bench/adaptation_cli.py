"""``adaflash bench adaptation``: argument parsing for bench.adaptation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register_bench(bsub: argparse._SubParsersAction) -> None:
    from bench.adaptation import METHODS, NARROW_DOMAINS

    a = bsub.add_parser("adaptation", help="online specialisation: held-out tau and TPS per update, "
                                           "frozen / OSD / reverse KL / full OPD")
    a.add_argument("--domain", default="math", help=f"narrow domain: {', '.join(sorted(NARROW_DOMAINS))}")
    a.add_argument("--rounds", type=int, default=12, help="updates (one buffer of records each)")
    a.add_argument("--records-per-round", type=int, default=8)
    a.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of the domain")
    a.add_argument("--max-tokens", type=int, default=96, help="answer length of streamed and held-out prompts")
    a.add_argument("--methods", default=",".join(METHODS))
    a.add_argument("--tps-prompts", type=int, default=4, help="held-out prompts served by the engine at C=1")
    a.add_argument("--tps-max-tokens", type=int, default=64)
    a.add_argument("--anchors-per-record", type=int, default=None, help="override the learner's setting")
    a.add_argument("--lr-drafter", type=float, default=None, help="override the learner's drafter learning rate")
    a.add_argument("--epochs", type=int, default=None, help="override the learner's epochs per buffer")
    a.add_argument("--lr-head", type=float, default=None, help="override the length head's learning rate")
    a.add_argument("--head-loss", choices=("bce", "mse"), default=None, help="override the length head's loss")
    a.add_argument("--drafter", default=None, help="bundle to start from (default: the starter)")
    a.add_argument("--out", default="out/bench-adaptation")
    a.set_defaults(func=adaptation)


def adaptation(args, settings) -> int:
    from adaflash.cli import CliError
    from bench.adaptation import NARROW_DOMAINS, run

    if args.domain not in NARROW_DOMAINS:
        raise CliError(f"unknown domain {args.domain!r}; choose from {', '.join(sorted(NARROW_DOMAINS))}")
    if args.drafter and not (Path(args.drafter) / "manifest.json").is_file():
        raise CliError(f"not a drafter bundle (no manifest.json): {args.drafter}")
    over = {key: val for key, val in (("anchors_per_record", args.anchors_per_record),
                                       ("lr_drafter", args.lr_drafter), ("epochs", args.epochs),
                                       ("lr_head", args.lr_head), ("head_loss", args.head_loss)) if val}
    try:
        result = run(settings, args.domain, args.rounds, Path(args.out), records_per_round=args.records_per_round,
                     n_eval=args.eval_prompts, max_tokens=args.max_tokens,
                     methods=tuple(m for m in args.methods.split(",") if m), tps_prompts=args.tps_prompts,
                     tps_max_tokens=args.tps_max_tokens, drafter_dir=args.drafter, learner_overrides=over)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(json.dumps({k: result[k] for k in ("domain", "rounds", "records_per_round", "summary", "engine_c1",
                                             "seconds")}, indent=2))
    return 0
