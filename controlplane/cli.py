"""``adaflash controlplane``: the admin API (and, later, its workers)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("controlplane", help="run the control plane's admin API",
                              description="Run the control plane: migrate its database, make sure an admin "
                                          "key exists ($ADAFLASH_HOME/admin-token) and serve the admin API.")
    p.add_argument("--host", default=None, help="listen address (default: controlplane.host)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: controlplane.port)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings) -> int:
    import uvicorn

    from controlplane.api import create_app

    host = args.host or settings.controlplane.host
    port = args.port if args.port is not None else settings.controlplane.port
    app = create_app(settings)
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
