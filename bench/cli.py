"""``adaflash bench throughput | adaptation | drafters | feedback | pii``: benchmarks that print JSON and draw PNGs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _csv(kind):
    def parse(s: str):
        try:
            return [kind(x) for x in s.split(",") if x]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list: {e}") from e

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH")
    t = bsub.add_parser("throughput", help="TPS, tau and latency of ar / fixed / adaptive")
    t.add_argument("--prompts", default=None, help="JSON lines {prompt, domain}; default: built-in held-out set")
    t.add_argument("--modes", type=_csv(str), default=["ar", "fixed", "adaptive"],
                   help="from ar, fixed, adaptive, adaptive-budget (adaptive with the cross-request verify budget)")
    t.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32])
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--per-domain", type=int, default=10, help="held-out prompts per domain (built-in set)")
    t.add_argument("--min-requests", type=int, default=4)
    t.add_argument("--drafter", default=None, help="drafter bundle directory, or 'random' (one that never pays)")
    t.add_argument("--llama-gguf", default=None,
                   help="GGUF of the target at the served precision, or 'auto' (the packaged target re-written at "
                        "the served precision, cached): compare ar with llama.cpp (llama-cpp-python)")
    t.add_argument("--no-transformers", action="store_true", help="skip the transformers generate baseline")
    t.add_argument("--repeats", type=int, default=1,
                   help="runs of every mode and concurrency, taking turns; reports each speedup's spread")
    t.add_argument("--out", default="out/bench-throughput")
    t.set_defaults(func=throughput)
    try:  # benches owned by other parts register themselves when present
        from bench.adaptation_cli import register_bench as reg_adapt

        reg_adapt(bsub)
    except ImportError:
        pass
    from bench.drafters import register_bench as reg_drafters

    reg_drafters(bsub)
    try:
        from bench.feedback import register_bench as reg_feedback

        reg_feedback(bsub)
    except ImportError:
        pass
    try:
        from bench.pii import register_bench as reg_pii

        reg_pii(bsub)
    except ImportError:
        pass
    try:
        from bench.promotion import register_bench as reg_promotion

        reg_promotion(bsub)
    except ImportError:
        pass
    try:
        from bench.soak import register_bench as reg_soak
        from bench.soak_fairness import register_bench as reg_fairness

        reg_soak(bsub)
        reg_fairness(bsub)
    except ImportError:
        pass


def throughput(args, settings) -> int:
    from adaflash.cli import CliError
    from bench.throughput import MODE_ORDER, run

    bad = [m for m in args.modes if m not in MODE_ORDER]
    if bad or not args.modes:
        raise CliError(f"unknown mode(s) {bad}; choose from {', '.join(MODE_ORDER)}")
    if not args.concurrency or min(args.concurrency) < 1:
        raise CliError("--concurrency needs positive integers")
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be positive")
    if args.repeats < 1:
        raise CliError("--repeats must be positive")
    if args.llama_gguf and args.llama_gguf != "auto" and not Path(args.llama_gguf).is_file():
        raise CliError(f"GGUF file not found: {args.llama_gguf}")
    if args.prompts and not Path(args.prompts).is_file():
        raise CliError(f"prompts file not found: {args.prompts}")
    try:
        result = run(settings, args.prompts, args.modes, args.concurrency, args.max_tokens, args.drafter,
                     Path(args.out), per_domain=args.per_domain, min_requests=args.min_requests,
                     compare_transformers=not args.no_transformers, llama_gguf=args.llama_gguf,
                     repeats=args.repeats)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(json.dumps(result, indent=2))
    return 0
