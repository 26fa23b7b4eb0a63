"""Registry over a real local MLflow (SQLite tracking store, local artifacts)."""

from __future__ import annotations

import json

import pytest

from adaflash.contracts import ALIAS_CHAMPION, ALIAS_PREVIOUS
from adaflash.contracts.registry import TAG_GATES, TAG_STATE
from controlplane.registry import ArtifactIntegrityError, Registry, RegistryError, publish_candidate
from tests.controlplane.drafter_fixture import TARGET, make_drafter_dir

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    return Registry(f"sqlite:///{root / 'mlflow.db'}", TARGET, artifact_root=root / "artifacts")


@pytest.fixture(scope="module")
def published(registry, tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    v1 = publish_candidate(registry, make_drafter_dir(src / "a", seed=1), params={"alpha": 0.8},
                           metrics={"loss": 1.5})
    v2 = publish_candidate(registry, make_drafter_dir(src / "b", seed=2))
    return v1, v2


def test_publish_and_discover(registry, published):
    v1, v2 = published
    assert registry.model_name == f"adaflash-drafter-{TARGET}"
    assert [v.version for v in registry.list_versions()] == [v1.version, v2.version]
    assert [v.version for v in registry.discover({v1.version})] == [v2.version]
    assert v1.source.endswith("/drafter") and v1.run_id


def test_download_verifies_every_file(registry, published, tmp_path):
    art = registry.download(published[0].version, tmp_path / "dl")
    assert sorted(art.manifest.files) == ["config.json", "model.safetensors"]
    manifest, digest = registry.fetch_manifest(published[0].version)
    assert digest == art.manifest_sha256 and manifest.files == art.manifest.files


def test_corrupted_artifact_is_refused(registry, tmp_path):
    src = make_drafter_dir(tmp_path / "c", seed=3)
    v = publish_candidate(registry, src)
    # Corrupt the stored copy (as a bad disk or a tampering hand would).
    store_dir = v.source.removeprefix("file://")
    with open(f"{store_dir}/model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ArtifactIntegrityError, match="sha256 mismatch for model.safetensors"):
        registry.download(v.version, tmp_path / "dl")


def test_replaced_manifest_is_refused(registry, tmp_path):
    v = publish_candidate(registry, make_drafter_dir(tmp_path / "d", seed=4))
    store_dir = v.source.removeprefix("file://")
    # A consistent-looking but different manifest: its digest no longer matches the tag.
    make_drafter_dir(tmp_path / "e", seed=5)
    for name in ("model.safetensors", "config.json", "manifest.json"):
        (tmp_path / "e" / name).replace(f"{store_dir}/{name}")
    with pytest.raises(ArtifactIntegrityError, match="manifest.json sha256"):
        registry.download(v.version, tmp_path / "dl")


def test_aliases_and_tags(registry, published):
    v1, v2 = published
    registry.set_champion(v1.version)
    registry.set_champion(v2.version)
    registry.set_champion(v2.version)  # repeating is harmless
    assert registry.alias(ALIAS_CHAMPION) == v2.version
    assert registry.alias(ALIAS_PREVIOUS) == v1.version
    registry.set_state(v2.version, "champion")
    registry.set_gate_results(v2.version, [{"name": "min_tau_gain", "passed": True}], "2026.1")
    tags = registry.get(v2.version).tags
    assert tags[TAG_STATE] == "champion" and json.loads(tags[TAG_GATES])[0]["passed"] is True
    assert registry.rollback() == v1.version
    assert registry.alias(ALIAS_CHAMPION) == v1.version and registry.alias(ALIAS_PREVIOUS) is None
    with pytest.raises(RegistryError, match="no 'previous'"):
        registry.rollback()


def test_discovery_records_new_versions_once(registry, published, tmp_path):
    from controlplane.db import make_engine, make_sessionmaker, session_scope, upgrade
    from controlplane.discovery import sync_versions
    from controlplane.gates import load_policy
    from controlplane.lifecycle import get_version

    bad = publish_candidate(registry, make_drafter_dir(tmp_path / "f", seed=6))
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "manifest.json").write_text("{not a manifest")
    (tmp_path / "g" / "manifest.json").replace(bad.source.removeprefix("file://") + "/manifest.json")
    altered = publish_candidate(registry, make_drafter_dir(tmp_path / "h", seed=7))
    with open(altered.source.removeprefix("file://") + "/model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")

    url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with session_scope(sessions) as s:
        found = {d.version: d for d in sync_versions(s, registry, load_policy())}
    assert set(found) == {v.version for v in registry.list_versions()}
    assert found[published[0].version].manifest_ok and not found[bad.version].manifest_ok
    with session_scope(sessions) as s:
        v1 = get_version(s, published[0].version)
        assert v1.state == "registered" and v1.manifest_sha256 == registry.fetch_manifest(v1.version)[1]
        assert v1.lineage["tenants"] == ["acme", "globex"] and v1.source_uri == published[0].source
        assert "manifest unreadable" in get_version(s, bad.version).state_reason
        # weights that do not match the manifest: rejected on sight, not queued for evaluation
        va = get_version(s, altered.version)
        assert va.state == "rejected" and "sha256 mismatch for model.safetensors" in va.state_reason
        assert not found[altered.version].manifest_ok
        assert sync_versions(s, registry, load_policy()) == []  # repeating finds nothing new
    assert registry.get(published[0].version).tags[TAG_STATE] == "registered"
    assert registry.get(altered.version).tags[TAG_STATE] == "rejected"
    engine.dispose()
