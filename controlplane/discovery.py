"""Registry -> database: record every new model version the learner registered.

The manifest is read for its digest and lineage; a version whose manifest cannot be read
is still recorded, with the reason, so that evaluation fails it visibly instead of it
being silently skipped. Every file is then checked against the manifest (downloaded to a
scratch directory): a version whose weights do not match is rejected at once, not left
queued behind the evaluations of others. Safe to repeat.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from adaflash.contracts.registry import TAG_STATE
from controlplane import lifecycle
from controlplane.gates import GatePolicy
from controlplane.models import Version
from controlplane.registry import ArtifactIntegrityError, Registry, RegistryError
from controlplane.states import VersionState

SYSTEM_DISCOVERY = "system:discovery"


@dataclass(frozen=True)
class Discovered:
    version: str
    manifest_ok: bool
    reason: str | None


def sync_versions(session: Session, registry: Registry, policy: GatePolicy) -> list[Discovered]:
    """Record the registry's versions the database lacks, in state ``registered``; the caller commits.

    Tags in MLflow are written after the rows are flushed; a crash between the two is
    repaired by ``mirror_states`` on the next pass.
    """
    known = set(session.scalars(select(Version.version)))
    found = []
    for rv in registry.discover(known):
        digest, lineage, reason = None, {}, None
        try:
            manifest, digest = registry.fetch_manifest(rv.version)
            lineage = manifest.lineage.model_dump(mode="json")
        except RegistryError as e:
            reason = f"manifest unreadable: {e}"
        v = lifecycle.register_version(session, version=rv.version, target_id=registry.target_id,
                                       source_uri=rv.source, run_id=rv.run_id, manifest_sha256=digest,
                                       lineage=lineage, created_at=rv.created_at,
                                       candidate_ttl_hours=policy.gates.candidate_ttl_hours,
                                       actor=SYSTEM_DISCOVERY, state_reason=reason)
        refused = _integrity_problem(registry, rv.version) if reason is None else None
        if refused:
            lifecycle.transition(session, v, VersionState.rejected, actor=SYSTEM_DISCOVERY,
                                 reason=f"artifact refused: {refused}")
        found.append(Discovered(rv.version, reason is None and refused is None, reason or refused))
    session.flush()
    mirror_states(session, registry)
    return found


def _integrity_problem(registry: Registry, version: str) -> str | None:
    """Why the version's files do not match its manifest, or None (also when they could not be
    fetched now: the evaluation downloads and checks them again)."""
    with tempfile.TemporaryDirectory(prefix="adaflash-discovery-") as tmp:
        try:
            registry.download(version, tmp)
        except ArtifactIntegrityError as e:
            return str(e)
        except RegistryError:
            return None
    return None


def mirror_states(session: Session, registry: Registry) -> int:
    """Write each version's database state into its MLflow tag where they differ."""
    tags = {rv.version: rv.tags.get(TAG_STATE) for rv in registry.list_versions()}
    changed = 0
    for v in session.scalars(select(Version)):
        if v.version in tags and tags[v.version] != v.state:
            registry.set_state(v.version, v.state)
            changed += 1
    return changed
