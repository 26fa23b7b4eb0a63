"""MLflow names shared by the learner (which publishes) and the control plane (which governs).

The registered model and aliases are in ``adaflash.contracts``; this module adds the
experiment name and the version tag keys.
"""

from __future__ import annotations

EXPERIMENT_PREFIX = "adaflash-"
MANIFEST_FILE = "manifest.json"

# Model-version tags. The control plane writes state and gates; the learner may write
# lineage and the manifest digest when it registers a version.
TAG_STATE = "adaflash.state"
TAG_GATES = "adaflash.gates"  # JSON list of gate results
TAG_LINEAGE = "adaflash.lineage"  # JSON lineage, as in manifest.json
TAG_MANIFEST_SHA256 = "adaflash.manifest_sha256"
TAG_POLICY_VERSION = "adaflash.policy_version"


def experiment_name(target_id: str) -> str:
    """MLflow experiment holding one run per published candidate for a target."""
    return EXPERIMENT_PREFIX + target_id
