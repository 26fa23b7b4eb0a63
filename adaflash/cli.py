"""The ``adaflash`` command line.

Each part contributes its subcommands through a ``register(subparsers)`` function in
its own ``cli`` module; they are looked up by name so that this package imports none
of the parts and ``adaflash --help`` stays fast (heavy imports happen inside commands).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from adaflash.config import ConfigError, load_config

# Modules that define ``register(subparsers)``; a missing one is simply not offered.
PART_CLIS = (
    "stack.cli",
    "demo.cli",
    "adaflash.admin_cli",
    "dataplane.cli",
    "learner.cli",
    "learner.offline_cli",
    "controlplane.cli",
    "governance.cli",
    "bench.cli",
)


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML configuration file (env ADAFLASH_* overrides it)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in PART_CLIS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        settings = load_config(args.config)
        rc = args.func(args, settings)
    except (CliError, ConfigError) as e:
        print(f"adaflash: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
