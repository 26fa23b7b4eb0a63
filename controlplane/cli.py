"""``adaflash controlplane``: the admin API and its workers; ``migrate`` and ``reap`` for jobs."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("controlplane", help="run the control plane's admin API and workers",
                              description="Run the control plane: migrate its database, make sure an admin "
                                          "key exists ($ADAFLASH_HOME/admin-token), serve the admin API and run "
                                          "its workers (discovery, shadow evaluation, gates, rollout, TTL reaper).")
    p.add_argument("--host", default=None, help="listen address (default: controlplane.host)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: controlplane.port)")
    p.add_argument("--no-workers", action="store_true", help="serve the API only (another replica runs the workers)")
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="controlplane_command", metavar="SUBCOMMAND")
    m = sub.add_parser("migrate", help="upgrade the control-plane database to the newest schema and exit")
    m.add_argument("--revision", default="head", help="Alembic revision to upgrade to (default: head)")
    m.set_defaults(func=migrate)
    r = sub.add_parser("reap", help="expire candidates older than their TTL once and exit (prints JSON)")
    r.set_defaults(func=reap)


def run(args: argparse.Namespace, settings) -> int:
    import uvicorn

    from adaflash.telemetry import CONTROLPLANE, setup_telemetry
    from controlplane.api import create_app
    from controlplane.worker import Workers

    host = args.host or settings.controlplane.host
    port = args.port if args.port is not None else settings.controlplane.port
    tel = setup_telemetry(CONTROLPLANE, settings)
    app = create_app(settings)
    workers = None
    if settings.controlplane.workers and not getattr(args, "no_workers", False):
        workers = Workers(settings, app.state.sessions, app.state.policy).start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        if workers is not None:
            workers.stop()
        tel.shutdown()
    return 0


def migrate(args: argparse.Namespace, settings) -> int:
    from controlplane.db import database_url, upgrade

    url = database_url(settings)
    upgrade(url, args.revision)
    print(json.dumps({"migrated": True, "revision": args.revision, "database": url.split("@")[-1]}))
    return 0


def reap(args: argparse.Namespace, settings) -> int:
    from controlplane.db import database_url, make_engine, make_sessionmaker
    from controlplane.registry import Registry
    from controlplane.worker import reap as reap_once

    engine = make_engine(database_url(settings))
    try:
        registry = None
        try:
            registry = Registry.from_settings(settings)
        except Exception:  # the database decides; MLflow tags are mirrored by the workers later
            registry = None
        expired = reap_once(make_sessionmaker(engine), registry)
    finally:
        engine.dispose()
    print(json.dumps({"expired": expired}))
    return 0
