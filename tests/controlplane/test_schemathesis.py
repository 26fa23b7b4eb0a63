"""Property-based run of the OpenAPI document against the live server: no 5xx, responses
match the documented status codes, content types and schemas, invalid input is refused.

Not checked: positive_data_acceptance (cross-field rules such as 'auditor keys need
tenants' are not expressible in the schema) and the Allow header Starlette sends with a 405.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.services
REPO = Path(__file__).resolve().parents[2]
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
         "negative_data_rejection"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "ADAFLASH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO),
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "adaflash.cli", "controlplane", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("control plane did not start:\n" + (tmp_path / "server.log").read_text())
            time.sleep(0.2)
        yield url, (tmp_path / "home" / "admin-token").read_text().strip(), tmp_path / "server.log"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def test_schemathesis_finds_no_server_errors(live_server):
    url, token, log = live_server
    cli = Path(sys.executable).parent / "schemathesis"
    r = subprocess.run([str(cli), "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {token}",
                        "--checks", CHECKS, "-n", "10", "--seed", "1", "-w", "1"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"},
                       cwd=log.parent)  # its cache directory lands there, not in the repository
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:] + log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
