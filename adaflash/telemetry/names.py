"""Names fixed across services: service names, span and attribute names, metric names."""






# service.name of each service.
DATAPLANE = "adaflash-dataplane"
LEARNER = "adaflash-learner"
CONTROLPLANE = "adaflash-controlplane"
SERVICES = (DATAPLANE, LEARNER, CONTROLPLANE)
SERVICE_NAMESPACE = "adaflash"


class Spans:
    """Span names, fixed here and nowhere else."""

    # dataplane
    REQUEST = "request"  # one HTTP completion request, root of its trace
    QUEUE = "queue"  # waiting for admission
    PREFILL = "prefill"
    SPEC_ROUND = "spec_round"  # attributes k_hat, accepted
    SCRUB = "scrub"  # PII scrubbing of the feedback record
    PRODUCE = "produce"  # feedback record to Kafka (or the spool)
    # learner
    TRAIN_STEP = "train_step"
    PUBLISH = "publish"  # candidate to MLflow
    # control plane
    SHADOW_EVALUATION = "shadow_evaluation"
    GATE = "gate"
    ROLLOUT = "rollout"

    ALL = (REQUEST, QUEUE, PREFILL, SPEC_ROUND, SCRUB, PRODUCE, TRAIN_STEP, PUBLISH,
           SHADOW_EVALUATION, GATE, ROLLOUT)


class SpanAttrs:
    """Attribute names used on spans and metrics."""

    TENANT = "tenant"
    K_HAT = "k_hat"
    ACCEPTED = "accepted"
    REQUEST_ID = "request_id"
    RECORD_ID = "record_id"
    NODE_ID = "node_id"
    MODE = "mode"
    DRAFTER_VERSION = "drafter_version"
    VERSION = "version"  # a registry version (candidate, champion)
    RECORDS = "records"  # how many feedback records a step used
    DECISION = "decision"  # a gate's or a rollout's outcome


class Metrics:
    """OpenTelemetry instrument names (seconds; attribute ``tenant``)."""

    TTFT = "adaflash.request.ttft"
    INTER_TOKEN_LATENCY = "adaflash.request.inter_token_latency"
    E2E_LATENCY = "adaflash.request.e2e_latency"

    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
    E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
