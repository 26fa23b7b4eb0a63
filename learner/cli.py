"""``adaflash learner``: run one online learner (consumer group member)."""

from __future__ import annotations

import argparse
import logging
import signal


def register(subparsers) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "learner", help="consume feedback, train the drafter online (OPD), publish candidates to MLflow")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: kafka.bootstrap)")
    p.add_argument("--state-dir", default=None, help="checkpoint directory (default: $ADAFLASH_HOME/learner)")
    p.add_argument("--init-drafter", default=None, help="drafter bundle to start from when there is no checkpoint")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many training steps")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="S",
                   help="stop after S seconds without records and with an empty buffer")
    p.add_argument("--no-publish", action="store_true", help="train and checkpoint, but publish nothing")
    p.set_defaults(func=run)


def run(args, settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.bootstrap:
        settings.kafka.bootstrap = args.bootstrap
    if args.state_dir:
        settings.learner.state_dir = args.state_dir
    if args.init_drafter:
        settings.learner.init_drafter = args.init_drafter
    from adaflash.telemetry import LEARNER, setup_telemetry
    from learner.service import Learner

    setup_telemetry(LEARNER, settings)

    publisher = None
    learner = Learner(settings)
    if not args.no_publish and settings.learner.publish_every:
        from learner.publish import Publisher

        publisher = Publisher.from_settings(settings, learner.identity)
    learner.publisher = publisher
    signal.signal(signal.SIGTERM, lambda *_: learner.stop_event.set())
    steps = learner.run(max_steps=args.max_steps, exit_when_idle_s=args.exit_when_idle)
    logging.getLogger("adaflash.learner").info("stopped after %d steps", steps)
    return 0
