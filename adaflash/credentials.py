"""Where every component finds its credentials: one rule, one place.

A credential is looked up the same way everywhere: the environment variable named in
the settings (non-empty, surrounding whitespace stripped), then a file (its first line),
configured or under ``$ADAFLASH_HOME``. Files the platform writes (generated tokens, keys
handed out by the control plane) are created with mode 0600 and replaced atomically; a
file that others can read is still used but logged as a warning. Secret values are never
logged.

| credential | env (setting) | file (setting, else under $ADAFLASH_HOME) |
|---|---|---|
| node admin endpoints | dataplane.admin_token_env | dataplane.admin_token_file, dataplane-admin-token (generated) |
| node -> control plane (reconcile, tenant policies) | dataplane.controlplane_token_env | dataplane.controlplane_token_file, node-token |
| learner -> control plane | learner.controlplane_token_env | learner.controlplane_token_file, learner-token |
| control plane's first admin key | - | controlplane.admin_token_file, admin-token (written once) |
| control plane -> nodes' admin endpoints | controlplane.node_admin_token_env | controlplane.node_admin_token_file, dataplane.admin_token_file, dataplane-admin-token |
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from adaflash.config import ControlplaneConfig, Settings

log = logging.getLogger("adaflash.credentials")

ADMIN_TOKEN_FILE = "admin-token"
DATAPLANE_ADMIN_TOKEN_FILE = "dataplane-admin-token"
NODE_TOKEN_FILE = "node-token"
LEARNER_TOKEN_FILE = "learner-token"


@dataclass(frozen=True)
class Credential:
    """Where one credential is looked for: ``env`` first, then each of ``files`` in order."""

    name: str  # for messages only
    env: str = ""
    files: tuple[Path, ...] = ()

    @property
    def path(self) -> Path | None:
        """The file a generated or handed-out value is written to (the first one)."""
        return self.files[0] if self.files else None


def read_file(path: str | os.PathLike) -> str | None:
    """The first line of a credential file, stripped; None if it is missing or empty."""
    p = Path(path)
    if not p.is_file():
        return None
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("credential file %s is readable by others (mode %o); chmod 600 it", p, stat.S_IMODE(mode))
    lines = p.read_text().strip().splitlines()
    if not lines:
        return None
    return lines[0].strip() or None


def lookup(cred: Credential) -> str | None:
    """The credential's value: env var, then files; None when none holds one."""
    if cred.env:
        value = os.environ.get(cred.env, "").strip()
        if value:
            return value
    for f in cred.files:
        value = read_file(f)
        if value:
            return value
    return None


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically (also over a wider old file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also when the temporary file existed with a wider mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, p)


def lookup_or_generate(cred: Credential) -> str:
    """The credential's value, or a new random token written to ``cred.path`` (0600)."""
    value = lookup(cred)
    if value:
        return value
    if cred.path is None:
        raise ValueError(f"{cred.name}: nowhere to write a generated token")
    value = secrets.token_urlsafe(32)
    write_private(cred.path, value + "\n")
    return value


def _files(*paths: str | os.PathLike) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(p) for p in paths if p))


def dataplane_admin(settings: Settings) -> Credential:
    """Bearer token of a node's admin endpoints (generated on first start if none is set)."""
    cfg = settings.dataplane
    return Credential("dataplane admin token", cfg.admin_token_env,
                      _files(cfg.admin_token_file or settings.home / DATAPLANE_ADMIN_TOKEN_FILE))


def node_controlplane(settings: Settings) -> Credential:
    """A node's API key at the control plane (heartbeats, deletions, tenant policies)."""
    cfg = settings.dataplane
    return Credential("node control-plane key", cfg.controlplane_token_env,
                      _files(cfg.controlplane_token_file or settings.home / NODE_TOKEN_FILE))


def learner_controlplane(settings: Settings) -> Credential:
    """The learner's API key at the control plane (deletion requests)."""
    cfg = settings.learner
    return Credential("learner control-plane key", cfg.controlplane_token_env,
                      _files(cfg.controlplane_token_file or settings.home / LEARNER_TOKEN_FILE))


def controlplane_admin(settings: Settings) -> Credential:
    """The control plane's first admin key (written once by the control plane, read by operators)."""
    return Credential("control-plane admin key", "",
                      _files(settings.controlplane.admin_token_file or settings.home / ADMIN_TOKEN_FILE))


def nodes_admin(settings: Settings) -> Credential:
    """The nodes' admin token as the control plane uses it to push drafters."""
    cp, dp = settings.controlplane, settings.dataplane
    return Credential("nodes' admin token", cp.node_admin_token_env,
                      _files(cp.node_admin_token_file, dp.admin_token_file,
                             settings.home / DATAPLANE_ADMIN_TOKEN_FILE))


def jwt_secret(cp: ControlplaneConfig) -> Credential:
    """The HS256 secret of bearer JWTs (used when ``jwt_issuer`` is set)."""
    return Credential("JWT secret", cp.jwt_secret_env, _files(cp.jwt_secret_file))


def console_secret(cp: ControlplaneConfig) -> Credential:
    """The secret that encrypts and signs the web console's session cookies (shared by replicas)."""
    return Credential("console secret", cp.console_secret_env, _files(cp.console_secret_file))
