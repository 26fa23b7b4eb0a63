"""The drafter registry over MLflow (names in ``adaflash.contracts`` and ``.registry``).

The learner publishes one run per candidate with the artifact ``drafter/`` and
registers it as a version of ``adaflash-drafter-<target>``. The control plane discovers
new versions here, mirrors their state and gate results into version tags, moves the
``champion`` / ``previous`` aliases, and downloads artifacts only after checking every
file against manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402
from mlflow.artifacts import download_artifacts  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from adaflash.config import Settings  # noqa: E402
from adaflash.contracts import (  # noqa: E402
    ALIAS_CHAMPION,
    ALIAS_PREVIOUS,
    DRAFTER_ARTIFACT_DIR,
    registered_model_name,
)
from adaflash.contracts.manifest import Manifest, verify_files  # noqa: E402
from adaflash.contracts.registry import (  # noqa: E402
    MANIFEST_FILE,
    TAG_GATES,
    TAG_MANIFEST_SHA256,
    TAG_POLICY_VERSION,
    TAG_STATE,
)
from adaflash.mlflow_store import ensure_experiment, ensure_registered_model, tracking_location  # noqa: E402

PAGE = 200


class RegistryError(RuntimeError):
    """The registry could not be read or written."""


class ArtifactIntegrityError(RegistryError):
    """An artifact whose files do not match its manifest (or the manifest its digest)."""


@dataclass(frozen=True)
class RegistryVersion:
    version: str
    run_id: str | None
    source: str  # artifact URI of the drafter/ directory
    created_at: datetime
    tags: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class VerifiedArtifact:
    path: Path  # local directory holding the drafter files and manifest.json
    manifest: Manifest
    manifest_sha256: str


def _is_missing(e: MlflowException) -> bool:
    return e.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


class Registry:
    def __init__(self, tracking_uri: str, target_id: str, artifact_root: str | Path | None = None):
        self.tracking_uri = tracking_uri
        self.target_id = target_id
        self.model_name = registered_model_name(target_id)
        # Where new experiments keep artifacts when the tracking store is local SQLite.
        self.artifact_root = Path(artifact_root) if artifact_root else None
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    @classmethod
    def from_settings(cls, settings: Settings) -> Registry:
        uri, root = tracking_location(settings)
        return cls(uri, settings.model.target_id, artifact_root=root)

    # -- experiment and registered model ---------------------------------------------
    def ensure_experiment(self) -> str:
        return ensure_experiment(self.client, self.target_id, self.artifact_root)

    def ensure_registered_model(self) -> None:
        ensure_registered_model(self.client, self.model_name)

    # -- versions ----------------------------------------------------------------------
    def _wrap(self, mv) -> RegistryVersion:
        return RegistryVersion(
            version=str(mv.version), run_id=mv.run_id or None, source=mv.source,
            created_at=datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC),
            tags=dict(mv.tags or {}), aliases=tuple(getattr(mv, "aliases", None) or ()))

    def list_versions(self) -> list[RegistryVersion]:
        """Every version of the registered model, oldest first (empty if none exists yet)."""
        out, token = [], None
        while True:
            page = self.client.search_model_versions(f"name='{self.model_name}'", max_results=PAGE,
                                                     page_token=token)
            out += [self._wrap(mv) for mv in page]
            token = page.token
            if not token:
                break
        return sorted(out, key=lambda v: int(v.version))

    def discover(self, known: Collection[str]) -> list[RegistryVersion]:
        """Versions the control plane has not recorded yet, oldest first."""
        return [v for v in self.list_versions() if v.version not in known]

    def get(self, version: str) -> RegistryVersion:
        return self._wrap(self.client.get_model_version(self.model_name, str(version)))

    def set_tags(self, version: str, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, str(version), key, value)

    def set_state(self, version: str, state: str) -> None:
        self.set_tags(version, {TAG_STATE: state})

    def set_gate_results(self, version: str, results: list[Mapping[str, Any]], policy_version: str) -> None:
        self.set_tags(version, {TAG_GATES: json.dumps(list(results), default=str),
                                TAG_POLICY_VERSION: policy_version})

    # -- aliases -----------------------------------------------------------------------
    def alias(self, alias: str) -> str | None:
        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException as e:
            if _is_missing(e) or "alias" in str(e).lower():
                return None
            raise

    def set_champion(self, version: str) -> None:
        """Make ``version`` the champion; the outgoing champion becomes ``previous``.
        Repeating the call for the same version changes nothing."""
        current = self.alias(ALIAS_CHAMPION)
        if current == str(version):
            return
        if current is not None:
            self.client.set_registered_model_alias(self.model_name, ALIAS_PREVIOUS, current)
        self.client.set_registered_model_alias(self.model_name, ALIAS_CHAMPION, str(version))

    def sync_aliases(self, wanted: Mapping[str, str | None]) -> list[str]:
        """Make each alias point where ``wanted`` says (None: no such alias); returns those changed."""
        changed = []
        for name, version in wanted.items():
            current = self.alias(name)
            if current == (str(version) if version is not None else None):
                continue
            if version is None:
                self.client.delete_registered_model_alias(self.model_name, name)
            else:
                self.client.set_registered_model_alias(self.model_name, name, str(version))
            changed.append(name)
        return changed

    def rollback(self) -> str:
        """Reinstate ``previous`` as champion; returns it. ``previous`` is cleared."""
        previous = self.alias(ALIAS_PREVIOUS)
        if previous is None:
            raise RegistryError(f"{self.model_name} has no {ALIAS_PREVIOUS!r} version to roll back to")
        self.client.set_registered_model_alias(self.model_name, ALIAS_CHAMPION, previous)
        self.client.delete_registered_model_alias(self.model_name, ALIAS_PREVIOUS)
        return previous

    # -- artifacts -----------------------------------------------------------------------
    def _download(self, uri: str, dest: Path) -> Path:
        try:
            return Path(download_artifacts(artifact_uri=uri, dst_path=str(dest), tracking_uri=self.tracking_uri))
        except (MlflowException, OSError) as e:
            raise RegistryError(f"cannot download {uri}: {e}") from e

    def _read_manifest(self, path: Path, rv: RegistryVersion) -> tuple[Manifest, str]:
        raw = path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        expected = rv.tags.get(TAG_MANIFEST_SHA256)
        if expected and expected != digest:
            raise ArtifactIntegrityError(f"version {rv.version}: manifest.json sha256 {digest} differs from "
                                         f"the registered {expected}")
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValidationError as e:
            raise ArtifactIntegrityError(f"version {rv.version}: manifest.json is invalid: {e}") from e
        if manifest.target.id != self.target_id:
            raise ArtifactIntegrityError(f"version {rv.version}: manifest is for target {manifest.target.id!r}, "
                                         f"not {self.target_id!r}")
        return manifest, digest

    def fetch_manifest(self, version: str) -> tuple[Manifest, str]:
        """The version's manifest and the sha256 of its bytes (files not downloaded)."""
        rv = self.get(version)
        with tempfile.TemporaryDirectory(prefix="adaflash-manifest-") as tmp:
            path = self._download(f"{rv.source.rstrip('/')}/{MANIFEST_FILE}", Path(tmp))
            return self._read_manifest(path, rv)

    def download(self, version: str, dest: str | Path) -> VerifiedArtifact:
        """Download ``drafter/`` into ``dest`` and check every file against manifest.json.

        Raises ``ArtifactIntegrityError`` on a missing, altered or unlisted file.
        """
        rv = self.get(version)
        local = self._download(rv.source, Path(dest))
        manifest_path = local / MANIFEST_FILE
        if not manifest_path.is_file():
            raise ArtifactIntegrityError(f"version {rv.version}: artifact has no {MANIFEST_FILE}")
        manifest, digest = self._read_manifest(manifest_path, rv)
        problems = verify_files(local, manifest)
        listed = set(manifest.files) | {MANIFEST_FILE}
        problems += [f"unlisted file {p.relative_to(local)}" for p in sorted(local.rglob("*"))
                     if p.is_file() and str(p.relative_to(local)) not in listed]
        if problems:
            raise ArtifactIntegrityError(f"version {rv.version}: " + "; ".join(problems))
        return VerifiedArtifact(local, manifest, digest)


def publish_candidate(registry: Registry, drafter_dir: str | Path, *, params: Mapping[str, Any] | None = None,
                      metrics: Mapping[str, float] | None = None,
                      tags: Mapping[str, str] | None = None) -> RegistryVersion:
    """What the learner does for each candidate: one run, ``drafter/``, one model version.

    Used by the embedded stack and tests; tags the manifest digest so the control plane
    can tell a replaced manifest from the published one.
    """
    drafter_dir = Path(drafter_dir)
    exp_id = registry.ensure_experiment()
    registry.ensure_registered_model()
    run = registry.client.create_run(exp_id)
    run_id = run.info.run_id
    for k, v in (params or {}).items():
        registry.client.log_param(run_id, k, v)
    for k, v in (metrics or {}).items():
        registry.client.log_metric(run_id, k, float(v))
    registry.client.log_artifacts(run_id, str(drafter_dir), artifact_path=DRAFTER_ARTIFACT_DIR)
    registry.client.set_terminated(run_id)
    digest = hashlib.sha256((drafter_dir / MANIFEST_FILE).read_bytes()).hexdigest()
    mv = registry.client.create_model_version(
        registry.model_name, source=f"{run.info.artifact_uri}/{DRAFTER_ARTIFACT_DIR}", run_id=run_id,
        tags={TAG_MANIFEST_SHA256: digest, **(tags or {})})
    return registry._wrap(mv)
