"""Where a learner starts from: its state directory, its tenants' policies and its first drafter."""

from __future__ import annotations

import logging
from pathlib import Path

from adaflash.config import Settings
from dataplane.drafter import Drafter, new_drafter
from dataplane.drafter_io import DrafterLoadError, load_bundle
from dataplane.model import TargetModel
from dataplane.node import STARTER_DIR  # the bundle a node serves when dataplane.drafter is empty
from learner.buffer import PolicySource, StaticPolicies

log = logging.getLogger("adaflash.learner")

__all__ = ["initial_drafter", "policy_source", "state_dir"]


def state_dir(settings: Settings) -> Path:
    return Path(settings.learner.state_dir) if settings.learner.state_dir else Path(settings.home) / "learner"


def policy_source(settings: Settings) -> PolicySource:
    g, lc = settings.governance, settings.learner
    if lc.tenant_policy_file:
        return StaticPolicies.from_file(lc.tenant_policy_file, g.default_ttl_days, g.default_share_cap)
    return StaticPolicies(ttl_days=g.default_ttl_days, share_cap=g.default_share_cap)


def initial_drafter(settings: Settings, target: TargetModel, identity: dict) -> tuple[Drafter, str | None]:
    """The drafter the learner starts from (before its own checkpoint, if any, is applied)."""
    path = settings.learner.init_drafter or settings.dataplane.drafter
    if path:
        drafter, manifest = load_bundle(path, target, identity)
        return drafter, manifest.version
    # Nothing configured: the node serves the committed starter (dataplane/starter) in that
    # case, so start from the same bundle when it was made for this target.
    if settings.dataplane.mode != "ar" and (STARTER_DIR / "manifest.json").is_file():
        try:
            drafter, manifest = load_bundle(STARTER_DIR, target, identity)
        except DrafterLoadError as e:
            log.warning("starter drafter not usable for this target (%s)", e)
        else:
            log.info("starting from the starter drafter %s (%s)", manifest.version, STARTER_DIR)
            return drafter, manifest.version
    log.warning("no initial drafter configured: starting from a random one")
    return new_drafter(target, seed=settings.learner.seed), None
