"""Contracts between the parts: imported everywhere, declared only here."""

FEEDBACK_TOPIC = "adaflash.feedback.v1"
FEEDBACK_DLQ_TOPIC = "adaflash.feedback.dlq.v1"
FEEDBACK_SCHEMA_VERSION = 1
HEADER_SCHEMA_VERSION = "schema_version"
HEADER_TRACEPARENT = "traceparent"
REGISTERED_MODEL_PREFIX = "adaflash-drafter-"
ALIAS_CHAMPION = "champion"
ALIAS_PREVIOUS = "previous"
DRAFTER_ARTIFACT_DIR = "drafter"
MANIFEST_FORMAT = "adaflash-drafter/1"


def registered_model_name(target_id: str) -> str:
    """MLflow registered model name for a target, e.g. ``adaflash-drafter-SmolLM2-135M-Instruct``."""
    return REGISTERED_MODEL_PREFIX + target_id
