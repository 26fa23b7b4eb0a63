"""Where the MLflow store is and how its experiment and registered model come to exist.

Shared by the learner (which publishes candidates) and the control plane (which governs
them), so both always agree on the default store and create the same objects.
"""

from __future__ import annotations

from pathlib import Path

from adaflash.config import Settings
from adaflash.contracts.registry import experiment_name


def tracking_location(settings: Settings) -> tuple[str, Path | None]:
    """(tracking URI, local artifact root or None): SQLite + local artifacts under $ADAFLASH_HOME
    unless controlplane.mlflow_tracking_uri names a server."""
    if settings.controlplane.mlflow_tracking_uri:
        return settings.controlplane.mlflow_tracking_uri, None
    home = Path(settings.home)
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}", home / "mlartifacts"


def ensure_experiment(client, target_id: str, artifact_root: Path | None) -> str:
    """Id of the target's experiment, created (artifacts under ``artifact_root``) if missing."""
    name = experiment_name(target_id)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = (Path(artifact_root) / name).as_uri() if artifact_root else None
    return client.create_experiment(name, artifact_location=location)


def ensure_registered_model(client, name: str) -> None:
    """Create the registered model unless it exists (either side may get there first)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name)
        except MlflowException:  # created meanwhile by the other side
            client.get_registered_model(name)
