"""``adaflash serve`` and ``adaflash model prepare``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one dataplane node (OpenAI-compatible HTTP)")
    p.add_argument("--mode", choices=["ar", "fixed", "adaptive"], default=None)
    p.add_argument("--drafter", default=None, help="drafter bundle directory (default: the committed starter)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--no-feedback", action="store_true", help="do not emit feedback records")
    p.set_defaults(func=serve)

    m = sub.add_parser("model", help="target model cache")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION")
    prep = msub.add_parser("prepare", help="convert the packaged GGUF target into the local cache (once)")
    prep.set_defaults(func=prepare)


def prepare(args, settings) -> int:
    from dataplane.target_cache import TargetUnavailable, ensure_target

    try:
        d = ensure_target(settings)
    except TargetUnavailable as e:
        from adaflash.cli import CliError

        raise CliError(str(e)) from e
    print(d)
    return 0


def serve(args, settings) -> int:
    import logging

    import uvicorn

    from adaflash import credentials
    from adaflash.cli import CliError
    from adaflash.telemetry import DATAPLANE, setup_telemetry
    from dataplane.drafter_io import DrafterLoadError
    from dataplane.node import Node
    from dataplane.reconcile import Reconciler
    from dataplane.server import create_app

    updates = {k: v for k, v in (("mode", args.mode), ("drafter", args.drafter), ("host", args.host),
                                 ("port", args.port)) if v is not None}
    settings.dataplane = settings.dataplane.model_copy(update=updates)
    if args.no_feedback:
        settings.governance = settings.governance.model_copy(update={"feedback_enabled": False})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat is noise
    try:
        node = Node(settings)
    except DrafterLoadError as e:
        raise CliError(f"cannot load drafter: {e}") from e
    token = credentials.lookup_or_generate(credentials.dataplane_admin(settings))
    cfg = settings.dataplane
    tel = setup_telemetry(DATAPLANE, settings, resource_attributes={"adaflash.node_id": node.node_id})
    public = cfg.public_url or f"http://{cfg.host}:{cfg.port}"
    attach_feedback(node, settings)
    node.engine.admission.policy = getattr(node.emitter, "policy", None)  # tenant weights and limits
    app = create_app(node, token)
    node.engine.start()
    rec = Reconciler.from_settings(node, public)
    if rec:
        rec.start()
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        if rec:
            rec.stop()
        node.engine.stop()
        node.close_feedback()  # queued records to the emitter, then the emitter's own drain
        tel.shutdown()
    return 0


def attach_feedback(node, settings) -> None:
    """Wire the governance emitter (scrub + produce off the serving path) when enabled."""
    if not settings.governance.feedback_enabled:
        return
    try:
        from governance.emitter import build_emitter
    except ImportError:
        return
    node.emitter = build_emitter(settings)
