"""Fixtures: a real database (SQLite file, or a throwaway PostgreSQL database), the app."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from fastapi.testclient import TestClient  # noqa: E402

from adaflash.config import load_config  # noqa: E402
from controlplane.api import create_app  # noqa: E402

PG_ADMIN_DSN = os.environ.get("ADAFLASH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one intra-op thread; two spin against each other on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Which database the control-plane tests run on when a test does not say: sqlite (default)
# or postgres (ADAFLASH_TEST_DATABASE=postgres runs every one of them on PostgreSQL).
TEST_DATABASE = os.environ.get("ADAFLASH_TEST_DATABASE", "sqlite").lower()


@pytest.fixture
def settings(request, tmp_path):
    """A fresh home and database: SQLite, or a PostgreSQL database cloned from this session's
    migrated one (parametrize indirectly with "postgresql", or set ADAFLASH_TEST_DATABASE)."""
    kind = getattr(request, "param", TEST_DATABASE)
    if kind in ("postgresql", "postgres"):
        url = request.getfixturevalue("pg_test_url")
        return load_config(home=tmp_path / "home", controlplane={"database_url": url})
    return load_config(home=tmp_path / "home")


@pytest.fixture
def app(settings):
    return create_app(settings)


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def admin(settings):
    """Headers carrying the admin key the app wrote on first start."""
    token = (settings.home / "admin-token").read_text().strip()
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def make_key(client, admin):
    def make(role: str, tenants: list[str] | None = None, node_id: str | None = None) -> dict[str, str]:
        r = client.post("/api/v1/keys", headers=admin,
                        json={"name": f"test-{role}", "role": role, "tenants": tenants or [], "node_id": node_id})
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['key']}"}

    return make


@pytest.fixture
def sessions(app):
    return app.state.sessions


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database with a random name, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin_conn = psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        # .ci/run starts PostgreSQL, so in CI a missing server is a failure, not a skip; a
        # developer machine without one still runs every SQLite test.
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL not reachable at {PG_ADMIN_DSN}: {e}")
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_DSN}: {e}")
    name = f"adaflash_test_{uuid.uuid4().hex[:12]}"
    admin_conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    try:
        yield f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}"
    finally:
        admin_conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_conn.close()


def _pg_admin():
    psycopg = pytest.importorskip("psycopg")
    try:
        return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        if os.environ.get("CI") or TEST_DATABASE in ("postgres", "postgresql"):
            pytest.fail(f"PostgreSQL not reachable at {PG_ADMIN_DSN}: {e}")
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_DSN}: {e}")


def _pg_url(name: str) -> str:
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    return f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}"


@pytest.fixture(scope="session")
def pg_session_db():
    """One uniquely named database per test session, migrated once, dropped at the end; each
    test gets a copy of it (``pg_test_url``)."""
    from controlplane.db import upgrade

    conn = _pg_admin()
    name = f"adaflash_session_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        upgrade(_pg_url(name))
        yield name
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@pytest.fixture
def pg_test_url(pg_session_db):
    """A migrated PostgreSQL database of its own for one test (a copy of the session's)."""
    conn = _pg_admin()
    name = f"{pg_session_db}_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_session_db}"')
    try:
        yield _pg_url(name)
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@pytest.fixture(scope="session")
def tansu():
    """A Kafka-compatible broker (Tansu, memory storage) on a free loopback port."""
    from governance.broker import BrokerError, TansuBroker

    try:
        broker = TansuBroker()
        broker.__enter__()
    except BrokerError as e:
        # the broker ships in a pinned dependency: in CI its absence is a failure
        if os.environ.get("CI"):
            pytest.fail(f"no Tansu broker: {e}")
        pytest.skip(f"no Tansu broker: {e}")
    try:
        yield broker.bootstrap
    finally:
        broker.__exit__(None, None, None)
