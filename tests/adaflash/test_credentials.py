"""Credentials are found the same way everywhere: env var, then file; written files are 0600."""

from __future__ import annotations

import logging
import stat

import pytest

from adaflash import credentials
from adaflash.config import load_config


def test_env_wins_then_configured_file_then_home(tmp_path, monkeypatch):
    s = load_config(None, home=tmp_path / "home")
    monkeypatch.delenv("ADAFLASH_NODE_TOKEN", raising=False)
    cred = credentials.node_controlplane(s)
    assert cred.path == tmp_path / "home" / credentials.NODE_TOKEN_FILE
    assert credentials.lookup(cred) is None
    credentials.write_private(cred.path, "from-home\n")
    assert credentials.lookup(cred) == "from-home"
    s.dataplane.controlplane_token_file = str(tmp_path / "configured")
    (tmp_path / "configured").write_text("  from-file  \nsecond line ignored\n")
    assert credentials.lookup(credentials.node_controlplane(s)) == "from-file"
    monkeypatch.setenv("ADAFLASH_NODE_TOKEN", " from-env ")
    assert credentials.lookup(credentials.node_controlplane(s)) == "from-env"
    monkeypatch.setenv("ADAFLASH_NODE_TOKEN", "   ")  # blank: as if unset
    assert credentials.lookup(credentials.node_controlplane(s)) == "from-file"


def test_generated_token_is_private_and_stable(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAFLASH_ADMIN_TOKEN", raising=False)
    s = load_config(None, home=tmp_path)
    first = credentials.lookup_or_generate(credentials.dataplane_admin(s))
    path = tmp_path / credentials.DATAPLANE_ADMIN_TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) >= 32 and credentials.lookup_or_generate(credentials.dataplane_admin(s)) == first


def test_write_private_narrows_a_wide_file_and_reading_one_warns(tmp_path, caplog):
    p = tmp_path / "key"
    p.write_text("old")
    p.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="adaflash.credentials"):
        assert credentials.read_file(p) == "old"
    assert "readable by others" in caplog.text and "old" not in caplog.text
    credentials.write_private(p, "new\n")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and credentials.read_file(p) == "new"


def test_every_component_uses_the_same_lookup(tmp_path, monkeypatch):
    s = load_config(None, home=tmp_path)
    monkeypatch.delenv("ADAFLASH_LEARNER_TOKEN", raising=False)
    monkeypatch.delenv("ADAFLASH_ADMIN_TOKEN", raising=False)
    credentials.write_private(tmp_path / credentials.LEARNER_TOKEN_FILE, "learner-key\n")
    credentials.write_private(tmp_path / credentials.DATAPLANE_ADMIN_TOKEN_FILE, "node-admin\n")
    from controlplane.auth import admin_token_path
    from controlplane.rollout import node_admin_token

    assert credentials.lookup(credentials.learner_controlplane(s)) == "learner-key"
    assert node_admin_token(s) == "node-admin"  # the control plane pushing to nodes
    assert admin_token_path(s) == tmp_path / credentials.ADMIN_TOKEN_FILE


def test_the_jwt_and_console_secrets_come_from_env_then_a_mounted_file(tmp_path, monkeypatch):
    from controlplane.auth import jwt_secret
    from controlplane.console.session import SessionCodec

    s = load_config(None, home=tmp_path)
    cp = s.controlplane
    cp.jwt_issuer = "https://issuer.example"
    monkeypatch.delenv(cp.jwt_secret_env, raising=False)
    monkeypatch.delenv(cp.console_secret_env, raising=False)
    with pytest.raises(RuntimeError, match="jwt_secret_file"):  # an issuer without a secret refuses to start
        jwt_secret(cp)
    credentials.write_private(tmp_path / "jwt", "mounted-jwt\n")
    cp.jwt_secret_file = str(tmp_path / "jwt")
    assert jwt_secret(cp) == "mounted-jwt"
    monkeypatch.setenv(cp.jwt_secret_env, "env-jwt")
    assert jwt_secret(cp) == "env-jwt"
    credentials.write_private(tmp_path / "console", "mounted-console\n")
    cp.console_secret_file = str(tmp_path / "console")
    a, b = SessionCodec(cp, "env-jwt"), SessionCodec(cp, "another")
    cookie = a.fernet.encrypt(b"x")
    assert b.fernet.decrypt(cookie) == b"x"  # both replicas read the mounted console secret
