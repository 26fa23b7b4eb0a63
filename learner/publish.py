"""Publishing a candidate drafter + length head to MLflow (DESIGN.md, MLflow contract).

One run per candidate in the experiment of the target, with params (alpha, delta, lrs,
buffer, ...), metrics (losses, clip ratio, head MAE, ...) and the artifact ``drafter/``:
the save_bundle directory (model.safetensors, config.json, manifest.json with lineage:
topic, partition offset ranges, tenants, time window, parent version). Then a version
of the registered model ``adaflash-drafter-<target>`` whose source is that directory,
tagged state=candidate, with the lineage and the manifest's sha256 (the control plane
checks the downloaded manifest against it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from adaflash.config import Settings  # noqa: E402
from adaflash.contracts import DRAFTER_ARTIFACT_DIR, registered_model_name  # noqa: E402
from adaflash.contracts.manifest import Lineage  # noqa: E402
from adaflash.contracts.registry import (  # noqa: E402
    MANIFEST_FILE,
    TAG_LINEAGE,
    TAG_MANIFEST_SHA256,
    TAG_STATE,
)
from adaflash.mlflow_store import ensure_experiment, ensure_registered_model, tracking_location  # noqa: E402
from dataplane.drafter import Drafter  # noqa: E402
from dataplane.drafter_io import save_bundle  # noqa: E402

STATE_CANDIDATE = "candidate"


@dataclass(frozen=True)
class Published:
    version: str  # registered model version
    run_id: str
    source: str  # artifact URI of drafter/
    manifest_sha256: str


class Publisher:
    def __init__(self, tracking_uri: str, target_identity: dict, artifact_root: str | Path | None = None):
        from mlflow import MlflowClient

        self.identity = target_identity
        self.target_id = target_identity["id"]
        self.model_name = registered_model_name(self.target_id)
        self.artifact_root = Path(artifact_root) if artifact_root else None
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    @classmethod
    def from_settings(cls, settings: Settings, target_identity: dict) -> Publisher:
        uri, root = tracking_location(settings)  # the same store as the control plane's
        return cls(uri, target_identity, root)

    def _experiment(self) -> str:
        return ensure_experiment(self.client, self.target_id, self.artifact_root)

    def _registered_model(self) -> None:
        ensure_registered_model(self.client, self.model_name)

    def publish(self, drafter: Drafter, lineage: Lineage, params: Mapping[str, object],
                metrics: Mapping[str, float], training: Mapping[str, object] | None = None,
                step: int | None = None) -> Published:
        exp_id = self._experiment()
        self._registered_model()
        run = self.client.create_run(exp_id, run_name=f"candidate-step-{step}" if step is not None else None,
                                     tags={"adaflash.kind": "candidate"})
        run_id = run.info.run_id
        try:
            for k, v in params.items():
                self.client.log_param(run_id, k, v)
            for k, v in metrics.items():
                self.client.log_metric(run_id, k, float(v), step=step or 0)
            with tempfile.TemporaryDirectory(prefix="adaflash-candidate-") as tmp:
                bundle = Path(tmp) / DRAFTER_ARTIFACT_DIR
                save_bundle(drafter, bundle, self.identity, version=f"run-{run_id}", lineage=lineage,
                            training={**(training or {}), "run_id": run_id, "params": dict(params)})
                digest = hashlib.sha256((bundle / MANIFEST_FILE).read_bytes()).hexdigest()
                self.client.log_artifacts(run_id, str(bundle), artifact_path=DRAFTER_ARTIFACT_DIR)
            self.client.set_terminated(run_id)
        except BaseException:
            self.client.set_terminated(run_id, status="FAILED")
            raise
        source = f"{run.info.artifact_uri}/{DRAFTER_ARTIFACT_DIR}"
        mv = self.client.create_model_version(
            self.model_name, source=source, run_id=run_id,
            tags={TAG_STATE: STATE_CANDIDATE, TAG_MANIFEST_SHA256: digest,
                  TAG_LINEAGE: json.dumps(lineage.model_dump(mode="json"))})
        return Published(str(mv.version), run_id, source, digest)
