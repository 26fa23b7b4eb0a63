"""``adaflash demo``: the command."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="drive held-out multi-tenant traffic through a running stack and show "
                                       "adaptation, gating and promotion live")
    demo.add_argument("--requests", type=int, default=None, help="measurement requests per phase (default 24)")
    demo.add_argument("--concurrency", type=int, default=8, help="concurrent requests (default 8)")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--timeout", type=float, default=1200.0,
                      help="deadline in seconds for a promotion during tenant traffic (default 1200)")
    demo.add_argument("--quiet-timeout", type=float, default=600.0,
                      help="seconds to wait for learners and shadow evaluation to pause before a measurement")
    demo.add_argument("--out", default=None, help="directory for the PNG and JSON (default $ADAFLASH_HOME/demo)")
    demo.add_argument("--no-auto-approve", action="store_true",
                      help="do not approve candidates that await approval (the demo policy approves)")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args, settings) -> int:
    from demo.run import run_demo

    return run_demo(args, settings)
